"""Runs pytest in Triton's interpreter and records each distinct kernel launch: which kernel,
its arguments' Triton types, its compile-time constants, its warps and any other compile
option it names, written as a JSON list to PATH when the run ends. `test_fused_ranks`
compiles every recorded launch for a GPU with them, which the interpreter never does.

    TRITON_INTERPRET=1 python tests/triton_launches.py PATH [pytest arguments]
"""

import inspect
import json
import sys

import pytest
import torch
from triton.runtime import interpreter

TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def triton_type(value):
    """How Triton's launcher types an argument: a pointer for a tensor, else its scalar type."""
    if torch.is_tensor(value):
        return "*" + TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a kernel argument {value!r}")


def recording(launches):
    """`InterpretedFunction.run`, adding each launch's record to the dict `launches`."""
    run = interpreter.InterpretedFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        parameters = inspect.signature(self.fn).parameters
        options = {key: kwargs[key] for key in list(kwargs) if key not in parameters}
        arguments = inspect.signature(self.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
        arguments.apply_defaults()
        constant = {name for name, p in parameters.items() if "constexpr" in str(p.annotation)}
        record = {
            "module": self.fn.__module__,
            "kernel": self.fn.__qualname__,
            "signature": {n: "constexpr" if n in constant else triton_type(v) for n, v in arguments.arguments.items()},
            "constants": {n: v for n, v in arguments.arguments.items() if n in constant},
            "num_warps": options.get("num_warps", 4),
            # The other compile options a launch names (the crossings kernel's enable_fp_fusion).
            "options": {key: value for key, value in options.items() if key != "num_warps"},
        }
        launches[json.dumps(record, sort_keys=True)] = record
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    return recorded_run


def main():
    launches = {}
    interpreter.InterpretedFunction.run = recording(launches)
    code = pytest.main(sys.argv[2:])
    with open(sys.argv[1], "w") as file:
        json.dump(list(launches.values()), file, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
