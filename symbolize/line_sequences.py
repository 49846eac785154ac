"""Line-table sequences of code the linker discarded, found in .debug_line's bytes.

GNU ld resolves the addresses of a section that --gc-sections dropped (a function of
-ffunction-sections nobody called) to 0, in .debug_line as in .debug_info. Such a function's
sequence then claims [0, its size): where that reaches past the start of the code (a PIE's
.text begins at 0x1000, and one gc'd function of 18 KB covers it), symbolic's SymCache gave the
real functions there the discarded one's lines (`main` at a line of the dropped function).
llvm-symbolizer and eu-addr2line keep the real ones. The sequences are moved out of the way,
in a copy of the file, by their DW_LNE_set_address operand: symtab.build_symbol_table.
"""

from __future__ import annotations

import struct

DW_LNE_END_SEQUENCE = 1
DW_LNE_SET_ADDRESS = 2
DW_LNS_ADVANCE_PC = 2
DW_LNS_CONST_ADD_PC = 8
DW_LNS_FIXED_ADVANCE_PC = 9
# Where a discarded sequence is moved, by the size of its address (8 bytes, or 4 in an ELF32
# file: i686, armhf): far above any code, and far enough below 2^64 (2^32) that its rows'
# advances do not wrap.
AWAY = {8: 0xFFFF_FF00_0000_0000, 4: 0xF000_0000}
# DW_LNE_set_address 0 as an 8-byte (4-byte) address encodes it: extended op, length 9 (5),
# the op, 0.
_SET_ADDRESS_0 = tuple(bytes([0, 1 + size, DW_LNE_SET_ADDRESS]) + bytes(size) for size in AWAY)


def _uleb(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def discarded_sequences(data: bytes, order: str, code_start: int) -> list[tuple[int, int]]:
    """(offset, size) in `data` (a whole, uncompressed .debug_line) of the address operands
    (8 or 4 bytes) that start a sequence at address 0 and reach `code_start` or past it. []
    for a table this does not read (an odd version or address size): nothing is moved then."""
    found: list[tuple[int, int]] = []
    # No sequence at 0, read at C speed (0.14 s a 1.3 MB table in Python: libc's).
    if not any(operand in data for operand in _SET_ADDRESS_0):
        return found
    unit = 0
    try:
        while unit + 4 <= len(data):
            length, = struct.unpack_from(order + "I", data, unit)
            offset_size, at = 4, unit + 4
            if length == 0xFFFFFFFF:
                length, = struct.unpack_from(order + "Q", data, at)
                offset_size, at = 8, at + 8
            end = at + length
            if end > len(data):
                return found
            version, = struct.unpack_from(order + "H", data, at)
            at += 2
            if version not in (2, 3, 4, 5):
                return found
            if version >= 5:
                if data[at] not in AWAY:  # address size
                    return found
                at += 2  # and the segment selector's size
            header_length, = struct.unpack_from(order + ("Q" if offset_size == 8 else "I"),
                                                data, at)
            at += offset_size
            program = at + header_length
            min_inst = data[at]
            at += 2 if version >= 4 else 1  # maximum_operations_per_instruction
            line_range = data[at + 2]
            opcode_base = data[at + 3]
            lengths = data[at + 4: at + 4 + opcode_base - 1]
            if not line_range or len(lengths) != opcode_base - 1:
                return found
            found += _sequences(data, order, program, end, min_inst, line_range, opcode_base,
                                lengths, code_start)
            unit = end
    except (IndexError, struct.error):  # a table cut short: what was read so far
        return found
    return found


def _sequences(data: bytes, order: str, at: int, end: int, min_inst: int, line_range: int,
               opcode_base: int, lengths: bytes, code_start: int) -> list[tuple[int, int]]:
    found: list[tuple[int, int]] = []
    address, start, operand = 0, None, (-1, 0)
    while at < end:
        op = data[at]
        at += 1
        if op >= opcode_base:
            address += (op - opcode_base) // line_range * min_inst
        elif op == 0:
            size, at = _uleb(data, at)
            sub = data[at]
            if sub == DW_LNE_SET_ADDRESS and size - 1 in AWAY:
                address, = struct.unpack_from(order + ("Q" if size == 9 else "I"), data, at + 1)
                if start is None:
                    start, operand = address, (at + 1, size - 1)
            elif sub == DW_LNE_END_SEQUENCE:
                if start == 0 and address > code_start:
                    found.append(operand)
                address, start, operand = 0, None, (-1, 0)
            at += size
        elif op == DW_LNS_ADVANCE_PC:
            advance, at = _uleb(data, at)
            address += advance * min_inst
        elif op == DW_LNS_CONST_ADD_PC:
            address += (255 - opcode_base) // line_range * min_inst
        elif op == DW_LNS_FIXED_ADVANCE_PC:
            advance, = struct.unpack_from(order + "H", data, at)
            address += advance
            at += 2
        else:
            for _ in range(lengths[op - 1]):
                _value, at = _uleb(data, at)
    return found
