// Generated from engine/spec.json by `python -m engine.spec`: edit that file, not this one.
// The facts the server and the browsers share (op table, graph limits, protocol constants).
// Classic script: attaches to self.crowdtrain.spec; load it before graph.js and runtime.js.
(self.crowdtrain = self.crowdtrain || {}).spec = Object.freeze({
  "graph": {
    "format": "crowdtrain.graph",
    "version": 1,
    "limits": {
      "nodes": 2000,
      "params": 500,
      "param_elements": 200000000,
      "name_length": 200,
      "max_int": 2147483647
    },
    "name_pattern": "[A-Za-z0-9_.:/-]+",
    "dtypes": {
      "inputs": [
        "float32",
        "int64"
      ],
      "targets": [
        "float32",
        "int64"
      ],
      "params": [
        "float32"
      ],
      "buffers": [
        "float32"
      ]
    },
    "ops": {
      "linear": {
        "inputs": [
          "x",
          "weight",
          "bias?"
        ]
      },
      "conv2d": {
        "inputs": [
          "x",
          "weight",
          "bias?"
        ],
        "attrs": {
          "stride": {
            "kind": "pair",
            "default": [
              1,
              1
            ]
          },
          "padding": {
            "kind": "pair",
            "default": [
              0,
              0
            ]
          },
          "dilation": {
            "kind": "pair",
            "default": [
              1,
              1
            ]
          },
          "groups": {
            "kind": "int",
            "default": 1
          }
        }
      },
      "batch_norm": {
        "inputs": [
          "x",
          "weight",
          "bias",
          "running_mean",
          "running_var"
        ],
        "attrs": {
          "eps": {
            "kind": "float",
            "default": 1e-05
          },
          "momentum": {
            "kind": "float",
            "default": 0.1
          }
        }
      },
      "layer_norm": {
        "inputs": [
          "x",
          "weight?",
          "bias?"
        ],
        "attrs": {
          "normalized_shape": {
            "kind": "ints"
          },
          "eps": {
            "kind": "float",
            "default": 1e-05
          }
        }
      },
      "embedding": {
        "inputs": [
          "ids",
          "weight"
        ],
        "attrs": {
          "padding_idx": {
            "kind": "int_or_none",
            "default": null
          }
        }
      },
      "relu": {
        "inputs": [
          "x"
        ]
      },
      "tanh": {
        "inputs": [
          "x"
        ]
      },
      "sigmoid": {
        "inputs": [
          "x"
        ]
      },
      "gelu": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "approximate": {
            "kind": "str",
            "default": "none",
            "choices": [
              "none",
              "tanh"
            ]
          }
        }
      },
      "softmax": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dim": {
            "kind": "int"
          }
        }
      },
      "log_softmax": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dim": {
            "kind": "int"
          }
        }
      },
      "dropout": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "p": {
            "kind": "float"
          }
        }
      },
      "max_pool2d": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "kernel_size": {
            "kind": "pair"
          },
          "stride": {
            "kind": "pair_or_none",
            "default": null
          },
          "padding": {
            "kind": "pair",
            "default": [
              0,
              0
            ]
          }
        }
      },
      "avg_pool2d": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "kernel_size": {
            "kind": "pair"
          },
          "stride": {
            "kind": "pair_or_none",
            "default": null
          },
          "padding": {
            "kind": "pair",
            "default": [
              0,
              0
            ]
          }
        }
      },
      "adaptive_avg_pool2d": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "output_size": {
            "kind": "pair"
          }
        }
      },
      "flatten": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "start_dim": {
            "kind": "int",
            "default": 1
          },
          "end_dim": {
            "kind": "int",
            "default": -1
          }
        }
      },
      "reshape": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "shape": {
            "kind": "ints"
          }
        }
      },
      "permute": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dims": {
            "kind": "ints"
          }
        }
      },
      "transpose": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dim0": {
            "kind": "int"
          },
          "dim1": {
            "kind": "int"
          }
        }
      },
      "add": {
        "inputs": [
          "a",
          "b"
        ]
      },
      "sub": {
        "inputs": [
          "a",
          "b"
        ]
      },
      "mul": {
        "inputs": [
          "a",
          "b"
        ]
      },
      "div": {
        "inputs": [
          "a",
          "b"
        ]
      },
      "scale": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "factor": {
            "kind": "float"
          }
        }
      },
      "matmul": {
        "inputs": [
          "a",
          "b"
        ]
      },
      "concat": {
        "inputs": [
          "x*"
        ],
        "attrs": {
          "dim": {
            "kind": "int"
          }
        }
      },
      "split": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dim": {
            "kind": "int"
          },
          "start": {
            "kind": "int"
          },
          "length": {
            "kind": "int"
          }
        }
      },
      "scaled_dot_product_attention": {
        "inputs": [
          "q",
          "k",
          "v"
        ],
        "attrs": {
          "is_causal": {
            "kind": "bool",
            "default": false
          }
        }
      },
      "arange_embedding": {
        "inputs": [
          "x",
          "weight"
        ]
      },
      "silu": {
        "inputs": [
          "x"
        ]
      },
      "hardswish": {
        "inputs": [
          "x"
        ]
      },
      "hardsigmoid": {
        "inputs": [
          "x"
        ]
      },
      "leaky_relu": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "negative_slope": {
            "kind": "float",
            "default": 0.01
          }
        }
      },
      "elu": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "alpha": {
            "kind": "float",
            "default": 1.0
          }
        }
      },
      "group_norm": {
        "inputs": [
          "x",
          "weight?",
          "bias?"
        ],
        "attrs": {
          "num_groups": {
            "kind": "int"
          },
          "eps": {
            "kind": "float",
            "default": 1e-05
          }
        }
      },
      "reduce_mean": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dims": {
            "kind": "ints"
          },
          "keepdim": {
            "kind": "bool",
            "default": false
          }
        }
      },
      "reduce_sum": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "dims": {
            "kind": "ints"
          },
          "keepdim": {
            "kind": "bool",
            "default": false
          }
        }
      },
      "add_scalar": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "value": {
            "kind": "float"
          }
        }
      },
      "dropout2d": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "p": {
            "kind": "float"
          }
        }
      },
      "expand": {
        "inputs": [
          "x",
          "like"
        ],
        "attrs": {
          "shape": {
            "kind": "ints"
          }
        }
      },
      "drop_path": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "p": {
            "kind": "float"
          }
        }
      },
      "interpolate": {
        "inputs": [
          "x"
        ],
        "attrs": {
          "size": {
            "kind": "pair"
          },
          "mode": {
            "kind": "str",
            "default": "nearest",
            "choices": [
              "nearest",
              "bilinear"
            ]
          },
          "align_corners": {
            "kind": "bool",
            "default": false
          }
        }
      },
      "conv_transpose2d": {
        "inputs": [
          "x",
          "weight",
          "bias?"
        ],
        "attrs": {
          "stride": {
            "kind": "pair",
            "default": [
              1,
              1
            ]
          },
          "padding": {
            "kind": "pair",
            "default": [
              0,
              0
            ]
          },
          "output_padding": {
            "kind": "pair",
            "default": [
              0,
              0
            ]
          }
        }
      }
    },
    "losses": {
      "cross_entropy": {
        "inputs": [
          "pred",
          "target",
          "weight?"
        ],
        "attrs": {
          "label_smoothing": {
            "kind": "float",
            "default": 0.0
          },
          "ignore_index": {
            "kind": "int",
            "default": -100
          }
        }
      },
      "mse": {
        "inputs": [
          "pred",
          "target"
        ]
      },
      "l1": {
        "inputs": [
          "pred",
          "target"
        ]
      }
    }
  },
  "protocol": {
    "version": 1,
    "max_in_flight": 2,
    "max_text_frame": 65536,
    "device_id_pattern": "^[A-Za-z0-9_-]{8,64}$",
    "client_messages": [
      "hello",
      "ready",
      "progress",
      "result",
      "release",
      "pause",
      "bye",
      "signal",
      "fetch",
      "relay"
    ],
    "server_messages": [
      "welcome",
      "preferences",
      "assign",
      "cancel",
      "ack",
      "credit",
      "idle",
      "error",
      "signal",
      "upload"
    ],
    "preferences": {
      "duty_cycle_percent": [
        10,
        100
      ]
    },
    "assign_why": [
      "choice",
      "share",
      "only"
    ],
    "idle_reasons": [
      "no_work",
      "download_limit",
      "too_large",
      "backoff"
    ],
    "close_codes": {
      "unauthenticated": 4401,
      "throttled": 4429,
      "retry_later": 4503
    },
    "signal": {
      "kinds": [
        "offer",
        "answer",
        "candidate"
      ],
      "max_data": 16384,
      "link_pattern": "^[A-Za-z0-9_-]{1,64}$"
    }
  }
});
