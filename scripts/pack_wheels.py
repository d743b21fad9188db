"""Repack wheels for the offline bundle (scripts/offline_bundle.sh): trim, and store uncompressed.

    python scripts/pack_wheels.py triton WHEEL OUT_DIR --python 3.12   # nvidia-pytriton -> tritonserver only
    python scripts/pack_wheels.py trim WHEEL OUT_DIR --drop GLOB ...    # drop unused members
    python scripts/pack_wheels.py store WHEEL OUT_DIR                   # same members, zip STORED

Every output wheel is written with ZIP_STORED: the bundle is one xz archive, and xz compresses raw
files far better than it recompresses deflated ones (numpy: 18 MB wheel -> 9.5 MB). A trimmed wheel
gets the local version `+trim` so nobody mistakes it for the upstream file; RECORD is rewritten.

The Triton rule keeps what `duplex serve` runs (serve/tritonserver.py): bin/tritonserver, the Python
backend, the stub of ONE Python version, and the closure of the ELF `NEEDED` libraries that live in
`nvidia_pytriton.libs` (read with `readelf -d`). `pytriton/__init__.py` is replaced by a stub: the
launcher only imports `pytriton` to find the folder, and the real one imports the whole PyTriton client.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import re
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

TRITON_ROOT = "pytriton/tritonserver/"
TRITON_LIBS = "nvidia_pytriton.libs/"
STUBS = TRITON_ROOT + "python_backend_stubs/"
TRITON_ENTRY = (TRITON_ROOT + "bin/tritonserver",)
PYTRITON_INIT = "pytriton/__init__.py"
PYTRITON_INIT_TEXT = (
    '"""nvidia-pytriton trimmed to tritonserver + the Python backend (scripts/pack_wheels.py)."""\n'
    "__version__ = \"{version}\"\n"
)
LOCAL_VERSION = "trim"
_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]")


def elf_needed(path: Path) -> list[str]:
    """The DT_NEEDED sonames of an ELF file (empty for a non-ELF file)."""
    if path.read_bytes()[:4] != b"\x7fELF":
        return []
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return _NEEDED.findall(out)


def triton_members(names: Iterable[str], needed: Callable[[str], list[str]], python: str) -> set[str]:
    """Members of the nvidia-pytriton wheel that tritonserver + the `python` stub need.

    `names` are the wheel's member paths; `needed(member)` returns the sonames that member links.
    """
    names = {n for n in names if not n.endswith("/")}
    stub = f"{STUBS}{python}/triton_python_backend_stub"
    if stub not in names:
        have = sorted({n[len(STUBS):].split("/")[0] for n in names if n.startswith(STUBS)})
        raise SystemExit(f"nvidia-pytriton has no stub for Python {python} (has {', '.join(have)})")
    backend = {n for n in names if n.startswith(TRITON_ROOT + "backends/python/") and "__pycache__" not in n}
    keep = {*TRITON_ENTRY, stub, *backend}
    libs = {n[len(TRITON_LIBS):]: n for n in names if n.startswith(TRITON_LIBS)}
    todo = [n for n in keep if not n.endswith(".py")]
    while todo:
        for soname in needed(todo.pop()):
            member = libs.get(soname)
            if member is not None and member not in keep:
                keep.add(member)
                todo.append(member)
    return keep


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _dist_info(names: Iterable[str]) -> str:
    found = [n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")]
    if not found:
        raise SystemExit("not a wheel: no .dist-info folder")
    return found[0]


def repack(wheel: Path, out_dir: Path, keep: Callable[[str], bool] = lambda _n: True,
           replace: dict[str, bytes] | None = None, local_version: str | None = None) -> Path:
    """Write `wheel`'s members that pass `keep` (plus `replace`) as a STORED wheel into `out_dir`."""
    replace = dict(replace or {})
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        info = _dist_info(names)
        dist, version = info[: -len(".dist-info")].rsplit("-", 1)
        new_version = f"{version}+{local_version}" if local_version else version
        old_prefix, new_prefix = f"{dist}-{version}.", f"{dist}-{new_version}."
        files: dict[str, bytes] = {}
        for name in names:
            if name.endswith("/") or name == f"{info}/RECORD" or not (keep(name) or name.startswith(info + "/")):
                continue
            if local_version and name == f"{info}/entry_points.txt":
                continue  # a trimmed wheel's console scripts may point at modules it no longer has
            data = replace.pop(name, None)
            files[name] = src.read(name) if data is None else data
        files.update(replace)
    if local_version:
        meta = files[f"{info}/METADATA"].decode()
        files[f"{info}/METADATA"] = re.sub(r"(?m)^Version: .*$", f"Version: {new_version}", meta, count=1).encode()
        files = {(new_prefix + n[len(old_prefix):] if n.startswith(old_prefix) else n): d for n, d in files.items()}
    record = f"{dist}-{new_version}.dist-info/RECORD"
    lines = [_record_line(n, d) for n, d in sorted(files.items())] + [f"{record},,"]
    files[record] = ("\n".join(lines) + "\n").encode()
    tail = wheel.name[len(f"{dist}-{version}"):]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / (f"{dist}-{new_version}{tail}" if local_version else wheel.name)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for name, data in files.items():
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            # the file-type bits matter: pip restores the execute bit only for entries marked S_IFREG
            zi.external_attr = (stat.S_IFREG | (0o755 if _is_executable(name, data) else 0o644)) << 16
            dst.writestr(zi, data)
    return out


def _is_executable(name: str, data: bytes) -> bool:
    return data[:4] == b"\x7fELF" or name.endswith(".sh") or "/bin/" in name


def trim_triton(wheel: Path, out_dir: Path, python: str) -> Path:
    with zipfile.ZipFile(wheel) as src, tempfile.TemporaryDirectory() as tmp:
        names = src.namelist()
        version = _dist_info(names)[: -len(".dist-info")].rsplit("-", 1)[1]

        def needed(member: str) -> list[str]:
            return elf_needed(Path(src.extract(member, tmp)))

        keep = triton_members(names, needed, python)
    init = PYTRITON_INIT_TEXT.format(version=f"{version}+{LOCAL_VERSION}").encode()
    return repack(wheel, out_dir, keep.__contains__, {PYTRITON_INIT: init}, LOCAL_VERSION)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("verb", choices=("triton", "trim", "store"))
    ap.add_argument("wheel", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--python", default="3.12", help="triton: the stub's Python version")
    ap.add_argument("--drop", nargs="*", default=[], help="trim: member globs to leave out")
    args = ap.parse_args(argv)
    if args.verb == "triton":
        out = trim_triton(args.wheel, args.out_dir, args.python)
    elif args.verb == "trim":
        out = repack(args.wheel, args.out_dir, lambda n: not any(fnmatch.fnmatch(n, g) for g in args.drop),
                     local_version=LOCAL_VERSION)
    else:
        out = repack(args.wheel, args.out_dir)
    print(f"{out.name}: {out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
