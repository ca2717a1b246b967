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
      // The settings as kept tensors, made once (so the tensor count is flat from the first step): a number
      // would be a new upload on every step.
      this.scalars = {};
      for (const value of [lr, momentum, 1 - dampening, weight_decay]) {
        if (!this.scalars[value]) this.scalars[value] = tf.keep(tf.scalar(value));
      }
    }

    scalar(value) { return this.scalars[value]; }

    // Matrices and kernels update with packed WebGL kernels (runtime.js withPackedElementwise), where their
    // matmuls read them; vectors are read by unpacked elementwise kernels.
    step(grads) {
      tf.tidy(() => {
        for (const [name, p] of Object.entries(this.params)) {
          const update = () => this.update(name, p, grads[name]);
          if (p.rank >= 2 && ns.runtime) ns.runtime.withPackedElementwise(update);
          else update();
        }
      });
    }

    update(name, p, grad) {
      const { lr, momentum, dampening, weight_decay, nesterov } = this.opts;
      let g = grad;
      if (weight_decay) g = tf.add(g, tf.mul(p, this.scalar(weight_decay)));
      if (momentum) {
        const buf = this.state[name];
        const fresh = dampening ? tf.mul(g, this.scalar(1 - dampening)) : g; // times 1 changes nothing
        const next = buf ? tf.add(tf.mul(buf, this.scalar(momentum)), fresh) : tf.clone(g);
        replace(this.state, name, next);
        g = nesterov ? tf.add(g, tf.mul(next, this.scalar(momentum))) : next;
      }
      p.assign(tf.sub(p, tf.mul(g, this.scalar(lr))));
    }

    dispose() {
      [...Object.values(this.state), ...Object.values(this.scalars)].forEach((t) => t.dispose());
      this.state = {};
      this.scalars = {};
    }
  }

  ns.optim = { SGD };
})((self.crowdtrain = self.crowdtrain || {}));
