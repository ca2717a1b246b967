// Load and validate a crowdtrain.graph (docs/graph-format.md) before anything runs it.
// Classic script: attaches to self.crowdtrain.graph; needs crowdtrain.spec (spec.js, from engine/spec.json),
// whose op table, limits and dtypes are the server's own (engine/graph.py reads the same file).
(function (ns) {
  "use strict";

  const SPEC = ns.spec.graph;
  const LIMITS = {
    nodes: SPEC.limits.nodes, params: SPEC.limits.params, paramElements: SPEC.limits.param_elements,
    nameLength: SPEC.limits.name_length,
  };
  const NAME_RE = new RegExp(`^(?:${SPEC.name_pattern})$`);
  // op -> {inputs: slot names, "?" optional (may be null), "*" variadic; attrs: {name: {kind, default?}}}.
  const OPS = SPEC.ops;
  // loss -> {inputs: [prediction, target, optional extras ("?")], attrs}, as for ops.
  const LOSSES = SPEC.losses;

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

  // The server's rule (engine/graph.py): one input per slot, null only in an optional one ("?"); a variadic
  // op ("*") takes one or more.
  function checkInputs(node, spec, known) {
    if (!Array.isArray(node.inputs)) fail(`inputs of ${node.name} must be a list`);
    const slots = spec.inputs, variadic = slots[slots.length - 1].endsWith("*");
    if (variadic ? node.inputs.length === 0 : node.inputs.length !== slots.length) {
      fail(`${node.name}: op ${node.op} takes inputs [${slots}], got ${node.inputs.length}`);
    }
    node.inputs.forEach((input, i) => {
      const slot = slots[Math.min(i, slots.length - 1)];
      if (input === null && !slot.endsWith("?")) fail(`${node.name}: input ${slot} may not be null`);
      if (input !== null && !known.has(input)) fail(`${node.name} uses unknown ${JSON.stringify(input)}`);
    });
  }

  // The server's rule for each attr kind (engine/graph.py, _norm_attr), without its rewriting of an int
  // into a pair (runtime.js reads both). A kind missing here fails every graph that uses it.
  const isInt = (v) => Number.isInteger(v) && Math.abs(v) <= SPEC.limits.max_int;
  const isPair = (v) => isInt(v) || (Array.isArray(v) && v.length === 2 && v.every(isInt));
  const KINDS = {
    int: isInt,
    int_or_none: (v) => v === null || isInt(v),
    float: (v) => typeof v === "number" && Number.isFinite(v),
    bool: (v) => typeof v === "boolean",
    str: (v, a) => typeof v === "string" && (a.choices || []).includes(v),
    ints: (v) => Array.isArray(v) && v.every(isInt),
    pair: isPair,
    pair_or_none: (v) => v === null || isPair(v),
  };

  function checkAttr(value, a, where) {
    const check = Object.hasOwn(KINDS, a.kind) ? KINDS[a.kind] : null;
    if (!check || !check(value, a)) fail(`${where}: invalid value ${JSON.stringify(value)} (expected ${a.kind})`);
    return value;
  }

  // The attrs with the spec's defaults filled in, as the server's loader does: the runtime reads every
  // attr from the node and keeps no defaults of its own.
  function withDefaults(node, spec) {
    const attrs = node.attrs === undefined || node.attrs === null ? {} : node.attrs;
    if (typeof attrs !== "object" || Array.isArray(attrs)) fail(`attrs of ${node.name} must be an object`);
    const specs = spec.attrs || {};
    const unknown = Object.keys(attrs).filter((key) => !Object.hasOwn(specs, key));
    if (unknown.length) fail(`${node.name}: unknown attrs [${unknown}] for op ${node.op}`);
    const out = {};
    for (const [key, a] of Object.entries(specs)) {
      if (Object.hasOwn(attrs, key)) out[key] = checkAttr(attrs[key], a, `${node.name} attr ${key}`);
      else if (Object.hasOwn(a, "default")) out[key] = Array.isArray(a.default) ? [...a.default] : a.default;
      else fail(`${node.name}: missing required attr ${key} for op ${node.op}`);
    }
    return out;
  }

  // A checked copy of the node, its attrs complete.
  function checkNode(node, known, ops) {
    checkName(node.name, "node");
    if (typeof node.op !== "string" || !Object.hasOwn(ops, node.op)) fail(`unknown op ${node.op} in ${node.name}`);
    checkInputs(node, ops[node.op], known);
    return { ...node, attrs: withDefaults(node, ops[node.op]) };
  }

  function checkLimits(graph) {
    if (!Array.isArray(graph.nodes) || graph.nodes.length > LIMITS.nodes) fail("too many nodes");
    if (graph.params.length > LIMITS.params) fail("too many params");
    const elements = graph.params.reduce((n, p) => n + p.shape.reduce((a, b) => a * b, 1), 0);
    if (elements > LIMITS.paramElements) fail("too many parameter elements");
  }

  // Returns a copy whose nodes carry every attr (defaults filled in).
  function validate(graph) {
    if (!graph || graph.format !== SPEC.format || graph.version !== SPEC.version) {
      fail(`not ${SPEC.format} v${SPEC.version}`);
    }
    checkSpecs(graph.inputs, "input", SPEC.dtypes.inputs);
    checkSpecs(graph.targets || [], "target", SPEC.dtypes.targets);
    checkSpecs(graph.params, "param", SPEC.dtypes.params);
    checkSpecs(graph.buffers || [], "buffer", SPEC.dtypes.buffers);
    checkLimits(graph);
    const known = new Set();
    for (const spec of [...graph.inputs, ...(graph.targets || []), ...graph.params, ...(graph.buffers || [])]) {
      if (known.has(spec.name)) fail(`duplicate name ${spec.name}`);
      known.add(spec.name);
    }
    const nodes = graph.nodes.map((raw) => {
      const node = checkNode(raw, known, OPS);
      if (known.has(node.name)) fail(`duplicate name ${node.name}`);
      known.add(node.name);
      return node;
    });
    if (!known.has(graph.output)) fail(`unknown output ${graph.output}`);
    if (!graph.loss) return { ...graph, nodes };
    return { ...graph, nodes, loss: checkLoss(graph) };
  }

  // The server's rule (engine/graph.py): inputs [output, a target] then the loss's optional ones (the class
  // weights, a buffer); a trailing null is dropped. Attrs get their defaults as a node's do.
  function checkLoss(graph) {
    const { op, inputs: raw } = graph.loss;
    if (typeof op !== "string" || !Object.hasOwn(LOSSES, op)) fail(`unknown op ${op} in loss`);
    const slots = LOSSES[op].inputs;
    const inputs = Array.isArray(raw) ? [...raw] : [];
    while (inputs.length > 2 && inputs.length <= slots.length && inputs[inputs.length - 1] === null) inputs.pop();
    const names = (specs) => new Set((specs || []).map((s) => s.name));
    const ok = inputs.length >= 2 && inputs.length <= slots.length && inputs[0] === graph.output &&
      names(graph.targets).has(inputs[1]) && inputs.slice(2).every((name) => names(graph.buffers).has(name));
    if (!ok) fail(`loss inputs must be [output, a target, optional buffers], got ${JSON.stringify(raw)}`);
    return { op, inputs, attrs: withDefaults({ name: "loss", ...graph.loss }, LOSSES[op]) };
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
