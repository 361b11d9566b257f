#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_ckpt_header.c into test/corpus/ckpt/:
a few tiny valid safetensors files (as smp writes them, and as Python's
safetensors writes them) and broken ones, one flaw each, and partial
checkpoints' manifests, valid and broken. Standard library
only; the output is deterministic.

    python3 test/gen_ckpt_corpus.py [OUT_DIR]
"""
import json
import os
import struct
import sys

from safetensors_common import SIZES, crc32c


def image(header_text, data):
    """Length prefix + header padded with spaces to 8 + data."""
    h = header_text.encode() if isinstance(header_text, str) else header_text
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def smp_file(tensors, meta=None, checksums=True, compact=True):
    """tensors: [(name, dtype, shape, bytes)] in data order."""
    meta = dict(meta or {})
    hdr, off, data = {}, 0, b""
    for name, dt, shape, raw in tensors:
        if checksums:
            meta["smp.checksum." + name] = "crc32c:%08x" % crc32c(raw)
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        data += raw
    if meta:
        hdr = {"__metadata__": meta, **hdr}
    sep = (",", ":") if compact else (", ", ": ")
    return image(json.dumps(hdr, separators=sep, ensure_ascii=compact), data)


def t(name, dt, shape, seed=1):
    n = SIZES[dt]
    for d in shape:
        n *= d
    if dt == "BOOL":
        return (name, dt, shape, bytes((seed + k) % 2 for k in range(n)))
    return (name, dt, shape, bytes((seed * 31 + k * 7) & 0xFF for k in range(n)))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "ckpt")
    os.makedirs(out, exist_ok=True)
    files = {}
    basic = [t("w", "F32", [2, 2]), t("b", "I64", [1], 2)]
    files["valid_basic"] = smp_file(basic, {"epoch": "3"})
    files["valid_all_dtypes"] = smp_file([t(dt.lower(), dt, [2], i) for i, dt in enumerate(SIZES)])
    files["valid_empty"] = image("{}", b"")
    files["valid_meta_only"] = smp_file([], {"k": "v", "x": ""})
    files["valid_scalar_zero"] = smp_file([t("s", "F64", []), t("z", "F32", [0, 3]), t("u", "U8", [3])])
    files["valid_escapes"] = smp_file([t("a\n\"\\/\u00e9\U0001F600", "U8", [2]), t("\t", "BOOL", [3])],
                                      {"note\u2603": "line\nbreak \"q\""}, compact=False)
    # as Python's safetensors writes: sorted by name, no smp checksums
    files["valid_python_style"] = smp_file([t("a.bias", "F32", [3]), t("a.weight", "F16", [2, 3])],
                                           {"format": "pt"}, checksums=False, compact=False)
    good = files["valid_basic"]
    hlen = struct.unpack("<Q", good[:8])[0]
    files["bad_short"] = good[:5]
    files["bad_len_too_big"] = struct.pack("<Q", len(good)) + good[8:]
    files["bad_truncated_data"] = good[:-3]
    flipped = bytearray(good)
    flipped[8 + hlen + 2] ^= 1
    files["bad_checksum"] = bytes(flipped)
    U8 = '"dtype":"U8","shape":[%s],"data_offsets":[%s]'
    raw = {  # name: (header, data bytes); each has exactly one flaw
        "bad_json_trailing_comma": ('{"a":{' + U8 % ("1", "0,1") + '},}', 1),
        "bad_json_unclosed": ('{"a":{' + U8 % ("1", "0,1") + '}', 1),
        "bad_json_no_colon": ('{"a" {' + U8 % ("1", "0,1") + '}}', 1),
        "bad_dtype": ('{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}', 4),
        "bad_shape_bytes": ('{"a":{' + U8 % ("2", "0,1") + '}}', 1),
        "bad_offsets_oob": ('{"a":{' + U8 % ("9", "0,9") + '}}', 1),
        "bad_overlap": ('{"a":{' + U8 % ("2", "0,2") + '},"b":{' + U8 % ("1", "1,2") + '}}', 2),
        "bad_gap": ('{"a":{' + U8 % ("1", "0,1") + '},"b":{' + U8 % ("1", "2,3") + '}}', 3),
        "bad_uncovered_tail": ('{"a":{' + U8 % ("1", "0,1") + '}}', 2),
        "bad_dup_name": ('{"a":{' + U8 % ("1", "0,1") + '},"a":{' + U8 % ("1", "1,2") + '}}', 2),
        "bad_meta_number": ('{"__metadata__":{"epoch":3}}', 0),
        "bad_too_many_dims": ('{"a":{' + U8 % ("1,1,1,1,1,1,1,1,1", "0,1") + '}}', 1),
        "bad_lone_surrogate": ('{"a\\ud800":{' + U8 % ("1", "0,1") + '}}', 1),
        "bad_nul_escape": ('{"a\\u0000":{' + U8 % ("1", "0,1") + '}}', 1),
        "bad_checksum_orphan": ('{"__metadata__":{"smp.checksum.b":"crc32c:00000000"},"a":{' + U8 % ("1", "0,1") + '}}', 1),
        "bad_deep_nesting": ('{"a":{"dtype":' + "[" * 40 + "]" * 40 + "}}", 0),
    }
    for name, (text, n) in raw.items():
        files[name] = image(text, bytes(range(1, n + 1)))
    files["bad_utf8"] = image(b'{"a\xff":{' + (U8 % ("1", "0,1")).encode() + b"}}", b"\x01")
    for name, blob in sorted(files.items()):
        with open(os.path.join(out, name + ".safetensors"), "wb") as fh:
            fh.write(blob)
    # partial checkpoints' manifests (the harness parses every input as one too)
    entry = '{"mp_rank": %d, "name": "model.g3_%d", "bytes": 1234, "header_crc32c": "crc32c:1a2b3c4d"}'
    def manifest(files_json, partitions=2, extra=""):
        return ('{\n  "format": "smp-checkpoint-manifest/1",\n  "kind": "partial",\n  "generation": 3,\n'
                '  "save_id": "65a1b2c3-1f-2",\n  "partitions": %d,%s\n  "files": [%s]\n}\n'
                % (partitions, extra, files_json)).encode()
    both = ", ".join(entry % (k, k) for k in range(2))
    manifests = {
        "manifest_valid": manifest(both),
        "manifest_bad_count": manifest(entry % (0, 0)),
        "manifest_bad_order": manifest(", ".join(entry % (k, k) for k in (1, 0))),
        "manifest_bad_key": manifest(both, extra=' "extra": 1,'),
        "manifest_bad_name": manifest(both.replace("model.g3_1", "../model.g3_1")),
        "manifest_bad_crc": manifest(both.replace("crc32c:1a2b3c4d", "crc32c:1A2B3C4D", 1)),
        "manifest_truncated": manifest(both)[:-20],
    }
    for name, blob in sorted(manifests.items()):
        with open(os.path.join(out, name + ".json"), "wb") as fh:
            fh.write(blob)
    print(f"wrote {len(files) + len(manifests)} files to {out}")


if __name__ == "__main__":
    main()
