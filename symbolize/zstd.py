"""zstd-compressed ELF sections (SHF_COMPRESSED with ELFCOMPRESS_ZSTD: `objcopy
--compress-debug-sections=zstd`, `gcc -gz=zstd`), inflated by the system's libzstd, as libdw is
called: symbolic reads such sections, so what is fixed up before it reads them must be read too."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

ELFCOMPRESS_ZSTD = 2
_MAX_RATIO = 64


@functools.cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
    except OSError:
        return None
    lib.ZSTD_decompress.restype = ctypes.c_size_t
    lib.ZSTD_decompress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                    ctypes.c_size_t]
    lib.ZSTD_isError.restype = ctypes.c_uint
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    return lib


def inflate(data: bytes, size: int) -> bytes | None:
    """The `size` bytes the zstd frames `data` hold; None where libzstd is missing, or `data`
    is not frames of exactly that many bytes."""
    lib = _lib()
    # The buffer is allocated (and zeroed) whole before a byte is inflated: a size claimed past
    # any real section's ratio (a line table packs some 5 to 15 times) is not believed.
    if lib is None or size > _MAX_RATIO * len(data) + (1 << 20):
        return None
    out = ctypes.create_string_buffer(size)
    got = lib.ZSTD_decompress(out, size, data, len(data))
    if lib.ZSTD_isError(got) or got != size:
        return None
    return out.raw
