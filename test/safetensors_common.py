"""What the Python checks of smp's safetensors files share: test.h-style
PASS/FAIL lines, element sizes per dtype, and CRC-32C (the checksum
smp_checkpoint.h records per tensor)."""
import sys

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}

failures = 0


def check(ok, name, why=""):
    global failures
    if ok:
        print(f"PASS: {name}")
    else:
        failures += 1
        print(f"FAIL: {name}: {why}")
    sys.stdout.flush()


def exit_status():
    """0 when every check passed, 3 when one failed (test.h's convention)."""
    return 3 if failures else 0


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF
