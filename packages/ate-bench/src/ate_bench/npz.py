"""A minimal reader for .npz archives (numpy's savez / savez_compressed), without numpy.

ate-bench must not depend on numpy (it benchmarks frameworks, it does not compute), but the
routing-trace task writes .npz files. An .npz is a zip of .npy files; a .npy file is the magic
b"\\x93NUMPY", a version, a little-endian header length, a Python-literal header dict
(descr, fortran_order, shape) and the raw array bytes. Numeric and bool dtypes are supported;
arrays come back as (shape, flat list in C order).
"""

import ast
import math
import struct
import zipfile
from pathlib import Path

MAGIC = b"\x93NUMPY"
# numpy dtype kind+size -> struct format character
STRUCT_CODES = {
    "b1": "?", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I",
    "i8": "q", "u8": "Q", "f2": "e", "f4": "f", "f8": "d",
}  # fmt: skip


class NpyArray:
    def __init__(self, shape: tuple[int, ...], kind: str, itemsize: int, values: list):
        self.shape = shape
        self.kind = kind  # 'b' bool, 'i' signed, 'u' unsigned, 'f' float
        self.itemsize = itemsize  # bytes per element
        self.values = values

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def rows(self) -> list[list]:
        """The array as rows of its last axis (a scalar is one row of one value)."""
        width = self.shape[-1] if self.shape else 1
        return [self.values[i : i + width] for i in range(0, len(self.values), width)] if width else []


def parse_npy(data: bytes, name: str = "array") -> NpyArray:
    if not data.startswith(MAGIC) or len(data) < 10:
        raise ValueError(f"expected {name} to start with the .npy magic, got {data[:8]!r}")
    major = data[6]
    if major == 1:
        (header_len,), start = struct.unpack("<H", data[8:10]), 10
    elif major in (2, 3):
        (header_len,), start = struct.unpack("<I", data[8:12]), 12
    else:
        raise ValueError(f"expected .npy format version 1, 2 or 3 in {name}, got {major}")
    header = ast.literal_eval(data[start : start + header_len].decode("latin1"))
    descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    if not isinstance(descr, str) or descr[1:] not in STRUCT_CODES:
        raise ValueError(f"expected a numeric or bool dtype in {name}, got {descr!r}")
    endian = ">" if descr[0] == ">" else "<"
    code = STRUCT_CODES[descr[1:]]
    count = math.prod(shape)
    body = data[start + header_len :]
    itemsize = struct.calcsize(code)
    if len(body) < count * itemsize:
        raise ValueError(f"expected {count * itemsize} data bytes in {name}, got {len(body)}")
    values = list(struct.unpack(f"{endian}{count}{code}", body[: count * itemsize]))
    if fortran and len(shape) > 1:
        values = fortran_to_c(values, shape)
    return NpyArray(shape, descr[1], itemsize, values)


def fortran_to_c(values: list, shape: tuple[int, ...]) -> list:
    strides_f = [math.prod(shape[:i]) for i in range(len(shape))]
    out = []
    index = [0] * len(shape)
    for _ in range(len(values)):
        out.append(values[sum(i * s for i, s in zip(index, strides_f))])
        for axis in reversed(range(len(shape))):  # advance the C-order (last axis fastest) index
            index[axis] += 1
            if index[axis] < shape[axis]:
                break
            index[axis] = 0
    return out


def load_npz(path: Path) -> dict[str, NpyArray]:
    """The arrays of an .npz file by name (the `.npy` suffix removed)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(f"expected {path} to be an .npz (zip) archive: {error}") from None
    with archive:
        return {
            member[: -len(".npy")] if member.endswith(".npy") else member: parse_npy(
                archive.read(member), f"{path}:{member}"
            )
            for member in archive.namelist()
        }
