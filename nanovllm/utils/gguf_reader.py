"""One pass over a GGUF file's header (ggml's docs/gguf.md, versions 2 and 3): every metadata value,
the tensor table, and zero-copy views of the tensor bytes through a memory map.

Why our own reader: gguf's GGUFReader builds a numpy view per metadata item (~2.6 s for the 100k
strings of SmolLM2's vocabulary and merges on 2 cores), and transformers ran it once each for the
config, the tokenizer and the weights. This reads the same header in ~0.2 s, once per LLM."""

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted with 32-bit ints and predates every file in use
# llama.cpp aligns the tensor data to this unless the file says otherwise (general.alignment).
DEFAULT_ALIGNMENT = 32
# Metadata value types (gguf.md, "gguf_metadata_value_type"): fixed-size ones by struct format.
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}
STRING_TYPE, ARRAY_TYPE = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists the fastest-moving dimension first
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    """`metadata` ({key: value}, arrays as lists) and `tensors` ({name: TensorInfo}) of one file.
    Picklable (tensor-parallel workers receive it): the memory map is reopened where it is used."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        buf = self._buffer()
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{path!r} is GGUF version {version}; supported: {list(SUPPORTED_VERSIONS)}")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string(buf)
            (value_type,) = self._unpack(buf, "<I")
            self.metadata[key] = self._value(buf, value_type)
        entries = []
        for _ in range(num_tensors):
            name = self._string(buf)
            (num_dims,) = self._unpack(buf, "<I")
            dims = self._unpack(buf, f"<{num_dims}Q")
            ggml_type, offset = self._unpack(buf, "<IQ")
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {name: TensorInfo(name, shape, ggml_type, data_start + offset)
                        for name, shape, ggml_type, offset in entries}

    def __getstate__(self) -> dict:
        return {"path": self.path, "metadata": self.metadata, "tensors": self.tensors}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map = None

    def _buffer(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    def bytes_of(self, info: TensorInfo, num_bytes: int) -> np.ndarray:
        """The tensor's raw bytes, a read-only view of the file (nothing is copied)."""
        return np.frombuffer(self._buffer(), dtype=np.uint8, count=num_bytes, offset=info.offset)

    # ---- header parsing; self._pos walks the header ----
    def _unpack(self, buf: mmap.mmap, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self, buf: mmap.mmap) -> str:
        (length,) = self._unpack(buf, "<Q")
        start, self._pos = self._pos, self._pos + length
        return buf[start:self._pos].decode("utf-8")

    def _value(self, buf: mmap.mmap, value_type: int) -> Any:
        if value_type in SCALAR_FORMATS:
            return self._unpack(buf, SCALAR_FORMATS[value_type])[0]
        if value_type == STRING_TYPE:
            return self._string(buf)
        if value_type != ARRAY_TYPE:
            raise ValueError(f"{self.path!r}: unknown GGUF metadata type {value_type}")
        element_type, count = self._unpack(buf, "<IQ")
        if element_type in SCALAR_FORMATS:  # read in one go: token types and scores run to 100k+
            fmt = SCALAR_FORMATS[element_type]
            values = np.frombuffer(buf, dtype=np.dtype(fmt), count=count, offset=self._pos)
            self._pos += count * struct.calcsize(fmt)
            return values.tolist()
        return [self._value(buf, element_type) for _ in range(count)]
