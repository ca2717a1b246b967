// The browsers' local optimizer with torch.optim.SGD's exact update rule (momentum, nesterov, dampening,
// weight decay), applied to the tf.Variables of a runtime model; engine/optim.py is the server's twin.
// SGD only: the protocol's `local.optimizer` is always "sgd". State tensors are kept explicitly and
// replaced each step, so the tensor count stays flat. Classic script: attaches to self.crowdtrain.optim.
(function (ns) {
  "use strict";

  function replace(state, key, next) {
    const old = state[key];
    state[key] = tf.keep(next);
    if (old) old.dispose();
  }

  // torch.optim.SGD: g += wd*p; buf = momentum*buf + (1-dampening)*g (buf = g on the first step);
  // g = nesterov ? g + momentum*buf : buf; p -= lr*g.
  class SGD {
    constructor(params, { lr, momentum = 0, dampening = 0, weight_decay = 0, nesterov = false }) {
      this.params = params;
      this.opts = { lr, momentum, dampening, weight_decay, nesterov };
      this.state = {};
    }

    step(grads) {
      const { lr, momentum, dampening, weight_decay, nesterov } = this.opts;
      tf.tidy(() => {
        for (const [name, p] of Object.entries(this.params)) {
          let g = grads[name];
          if (weight_decay) g = tf.add(g, tf.mul(p, weight_decay));
          if (momentum) {
            const buf = this.state[name];
            const next = buf ? tf.add(tf.mul(buf, momentum), tf.mul(g, 1 - dampening)) : tf.clone(g);
            replace(this.state, name, next);
            g = nesterov ? tf.add(g, tf.mul(next, momentum)) : next;
          }
          p.assign(tf.sub(p, tf.mul(g, lr)));
        }
      });
    }

    dispose() { Object.values(this.state).forEach((t) => t.dispose()); this.state = {}; }
  }

  ns.optim = { SGD };
})((self.crowdtrain = self.crowdtrain || {}));
