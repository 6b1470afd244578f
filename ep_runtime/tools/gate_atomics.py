"""The compile gate's check of a build's atomics: no global atomic on shared memory.

An atomic on a shared array must be a shared one (``atom.shared`` / ``red.shared``, or a generic
``atom`` on a generic address). A global atomic (``atom.global`` / ``red.global``) whose address
is a shared-window address updates no shared memory: on a GPU it faults or corrupts whatever
global memory sits there. numba-cuda-mlir 0.6.0 emits exactly that for an atomic on a shared
array passed to a device function (docs/upstream/numba-cuda-mlir-shared-atomic.md), and ptxas
accepts it unless the address folds to an immediate: the build links and is wrong. This check
reads the linked PTX (after link-time optimization: the code the cubin is built from) and
reports every global atomic whose address

- is an immediate (``[0]``): no global data has a numeric address, or
- derives, within its function, from a shared-window address or a constant one: a ``.shared``
  variable; a register written by ``cvta.shared`` / ``cvta.to.shared``; one written by an
  ``add`` whose first operand is a number (what NVPTX emits for an offset from a constant
  pointer: numba-cuda-mlir's ``add.s64 %rd2158, 0, %rd2157`` for an index into a shared array at
  window offset 0); or one written by an instruction that reads such a register (``mov``,
  ``add``, ``mad``, ``cvt`` ...), followed to a fixed point.

What it cannot see: a function that is not inlined receives an array's address as a parameter,
and there a global atomic on it reads as a global one whatever the caller passed. The rule holds
for what the PTX shows; ``cuda_api.shared_atomic`` at every atomic on a shared array inside a
device function is what keeps the rest right.
"""

from __future__ import annotations

import re

#: A global atomic or reduction and its address operand.
_GLOBAL_ATOMIC = re.compile(r"^\s*(?:@!?%\w+\s+)?(atom|red)\.global\.[\w.]*\s+(?:[^\[]*)\[([^\]]+)\]")
#: A register written from a shared-window address (``cvta.shared`` / ``cvta.to.shared``), or as an
#: offset from a constant address (an ``add`` whose first operand is a number).
_SHARED_OR_CONSTANT_BASE = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:cvta(?:\.to)?\.shared\.u(?:32|64)\s+(%\w+)"
                                      r"|add\.[su](?:32|64)\s+(%\w+)\s*,\s*-?(?:0[xX][0-9a-fA-F]+|\d+)\s*,)")
#: An instruction's destination register and its source operands.
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,\s*(.*?);")
#: Instructions through which an address flows from a source operand to the destination.
_ADDRESS_FLOW = ("mov", "add", "sub", "mad", "cvt", "or", "and", "selp", "shl")
#: A ``.shared`` variable's declaration.
_SHARED_VARIABLE = re.compile(r"^\s*(?:\.extern\s+)?\.shared\s+.*?([A-Za-z_$][\w$]*)\s*(?:\[[^\]]*\])*\s*;")
#: Where a function's body starts (``.entry`` / ``.func``).
_FUNCTION = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\b")


def _functions(ptx: str) -> list[list[str]]:
    """The lines of each function of ``ptx`` (a new one starts at each ``.entry`` / ``.func``)."""
    functions, current = [], []
    for line in ptx.splitlines():
        if _FUNCTION.match(line) and current:
            functions.append(current)
            current = []
        current.append(line)
    functions.append(current)
    return functions


def _shared_registers(lines: list[str], shared_variables: set[str]) -> set[str]:
    """Registers of one function that hold a shared-window or constant address, or one derived from it."""
    shared = {m.group(1) or m.group(2) for line in lines if (m := _SHARED_OR_CONSTANT_BASE.match(line))}
    flows = []
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m and m.group(1).split(".")[0] in _ADDRESS_FLOW:
            sources = set(re.findall(r"[%A-Za-z_$][\w$]*", m.group(3)))
            flows.append((m.group(2), sources))
            if sources & shared_variables:
                shared.add(m.group(2))
    changed = True
    while changed:
        changed = False
        for destination, sources in flows:
            if destination not in shared and sources & shared:
                shared.add(destination)
                changed = True
    return shared


def global_atomics_on_shared(ptx: str) -> list[str]:
    """The global atomics of linked PTX ``ptx`` whose address is an immediate or a shared-window
    address (the module docstring's rule), as their PTX lines, stripped; empty when none."""
    shared_variables = {m.group(1) for line in ptx.splitlines() if (m := _SHARED_VARIABLE.match(line))}
    found = []
    for lines in _functions(ptx):
        shared = None
        for line in lines:
            m = _GLOBAL_ATOMIC.match(line)
            if not m:
                continue
            base = m.group(2).split("+")[0].strip()
            if shared is None:
                shared = _shared_registers(lines, shared_variables)
            if re.fullmatch(r"-?(?:0[xX][0-9a-fA-F]+|\d+)", base) or base in shared or base in shared_variables:
                found.append(line.strip())
    return found


__all__ = ["global_atomics_on_shared"]
