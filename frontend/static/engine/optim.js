// Optimizers with torch.optim's exact update rules (SGD with momentum/nesterov, Adam), applied to the
// tf.Variables of a runtime model. State tensors are kept explicitly and replaced each step, so the
// tensor count stays flat. Classic script: attaches to self.crowdtrain.optim.
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

  // torch.optim.Adam (amsgrad off): p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
  class Adam {
    constructor(params, { lr = 1e-3, betas = [0.9, 0.999], eps = 1e-8, weight_decay = 0 } = {}) {
      this.params = params;
      this.opts = { lr, betas, eps, weight_decay };
      this.m = {};
      this.v = {};
      this.t = 0;
    }

    step(grads) {
      const { lr, betas: [b1, b2], eps, weight_decay } = this.opts;
      this.t += 1;
      const bc1 = 1 - b1 ** this.t, bc2 = 1 - b2 ** this.t;
      tf.tidy(() => {
        for (const [name, p] of Object.entries(this.params)) {
          let g = grads[name];
          if (weight_decay) g = tf.add(g, tf.mul(p, weight_decay));
          const m = this.m[name] ? tf.add(tf.mul(this.m[name], b1), tf.mul(g, 1 - b1)) : tf.mul(g, 1 - b1);
          const v = this.v[name] ? tf.add(tf.mul(this.v[name], b2), tf.mul(tf.square(g), 1 - b2))
            : tf.mul(tf.square(g), 1 - b2);
          replace(this.m, name, m);
          replace(this.v, name, v);
          const denom = tf.add(tf.div(tf.sqrt(v), Math.sqrt(bc2)), eps);
          p.assign(tf.sub(p, tf.mul(tf.div(m, denom), lr / bc1)));
        }
      });
    }

    dispose() {
      [...Object.values(this.m), ...Object.values(this.v)].forEach((t) => t.dispose());
      this.m = {};
      this.v = {};
    }
  }

  ns.optim = { SGD, Adam };
})((self.crowdtrain = self.crowdtrain || {}));
