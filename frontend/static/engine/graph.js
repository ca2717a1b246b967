// Load and validate a crowdtrain.graph (docs/graph-format.md) before anything runs it.
// Classic script: attaches to self.crowdtrain.graph.
(function (ns) {
  "use strict";

  const LIMITS = { nodes: 2000, params: 500, paramElements: 200e6, nameLength: 200 };
  const NAME_RE = /^[A-Za-z0-9_.:/-]+$/;

  // op -> [min inputs, max inputs]; Infinity for concat.
  const OPS = {
    linear: [2, 3], conv2d: [2, 3], batch_norm: [5, 5], layer_norm: [1, 3], embedding: [2, 2],
    relu: [1, 1], tanh: [1, 1], sigmoid: [1, 1], gelu: [1, 1], softmax: [1, 1], log_softmax: [1, 1],
    dropout: [1, 1], max_pool2d: [1, 1], avg_pool2d: [1, 1], adaptive_avg_pool2d: [1, 1],
    flatten: [1, 1], reshape: [1, 1], permute: [1, 1], transpose: [1, 1],
    add: [2, 2], sub: [2, 2], mul: [2, 2], div: [2, 2], scale: [1, 1], matmul: [2, 2],
    concat: [1, Infinity], split: [1, 1], scaled_dot_product_attention: [3, 3], arange_embedding: [2, 2],
  };
  const LOSSES = { cross_entropy: 2, mse: 2 };

  function fail(msg) { throw new Error(`invalid graph: ${msg}`); }

  function checkName(name, what) {
    if (typeof name !== "string" || name.length > LIMITS.nameLength || !NAME_RE.test(name)) {
      fail(`bad ${what} name ${JSON.stringify(name)}`);
    }
  }

  function checkSpecs(list, what, dtypes) {
    if (!Array.isArray(list)) fail(`${what} must be a list`);
    for (const spec of list) {
      checkName(spec.name, what);
      if (!Array.isArray(spec.shape) || !spec.shape.every(Number.isInteger)) fail(`bad shape for ${spec.name}`);
      if (!dtypes.includes(spec.dtype)) fail(`bad dtype ${spec.dtype} for ${spec.name}`);
    }
  }

  function checkNode(node, known, ops) {
    checkName(node.name, "node");
    if (!(node.op in ops)) fail(`unknown op ${node.op} in ${node.name}`);
    if (!Array.isArray(node.inputs)) fail(`inputs of ${node.name} must be a list`);
    const [lo, hi] = Array.isArray(ops[node.op]) ? ops[node.op] : [ops[node.op], ops[node.op]];
    if (node.inputs.length < lo || node.inputs.length > hi) fail(`${node.name}: wrong number of inputs`);
    for (const input of node.inputs) {
      if (input !== null && !known.has(input)) fail(`${node.name} uses unknown ${JSON.stringify(input)}`);
    }
    if (node.attrs !== undefined && (typeof node.attrs !== "object" || node.attrs === null)) {
      fail(`attrs of ${node.name} must be an object`);
    }
  }

  function validate(graph) {
    if (!graph || graph.format !== "crowdtrain.graph" || graph.version !== 1) fail("not crowdtrain.graph v1");
    checkSpecs(graph.inputs, "input", ["float32", "int64"]);
    checkSpecs(graph.targets || [], "target", ["float32", "int64"]);
    checkSpecs(graph.params, "param", ["float32"]);
    checkSpecs(graph.buffers || [], "buffer", ["float32"]);
    if (!Array.isArray(graph.nodes) || graph.nodes.length > LIMITS.nodes) fail("too many nodes");
    if (graph.params.length > LIMITS.params) fail("too many params");
    const elements = graph.params.reduce((n, p) => n + p.shape.reduce((a, b) => a * b, 1), 0);
    if (elements > LIMITS.paramElements) fail("too many parameter elements");
    const known = new Set();
    for (const spec of [...graph.inputs, ...(graph.targets || []), ...graph.params, ...(graph.buffers || [])]) {
      if (known.has(spec.name)) fail(`duplicate name ${spec.name}`);
      known.add(spec.name);
    }
    for (const node of graph.nodes) {
      checkNode(node, known, OPS);
      if (known.has(node.name)) fail(`duplicate name ${node.name}`);
      known.add(node.name);
    }
    if (!known.has(graph.output)) fail(`unknown output ${graph.output}`);
    if (graph.loss) checkNode({ name: "loss", ...graph.loss }, known, LOSSES);
    return graph;
  }

  // Accepts JSON text, bytes or an already-parsed object.
  function load(source) {
    let graph = source;
    if (source instanceof ArrayBuffer || ArrayBuffer.isView(source)) graph = new TextDecoder().decode(source);
    if (typeof graph === "string") graph = JSON.parse(graph);
    return validate(graph);
  }

  function hasOp(graph, ops) { return graph.nodes.some((n) => ops.includes(n.op)); }

  ns.graph = { load, validate, hasOp, OPS, LOSSES, LIMITS };
})((self.crowdtrain = self.crowdtrain || {}));
