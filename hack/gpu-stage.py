#!/usr/bin/env python3
"""Stage vLLM, the torch it pins and Ray as wheel parts for the lent GPU machine (it has no network).

The GPU image (see ../shared/gpu/README.md) has CPython 3.12, torch 2.11.0 with the CUDA 13.0 libraries,
transformers 5.17, no vLLM and no Ray. ../shared/gpu/gpu_image_packages.txt lists its installed package
names (names only, no versions). vLLM 0.27+ pins a newer torch than the image's, so this script stages that
torch and the NVIDIA/triton wheels it pins as well, next to vLLM and Ray, installed with
`pip install --target /tmp/site-<vllm version>` and used through PYTHONPATH (ahead of the image's own).

What it does (on the CPU machine; costs no GPU time):
1. resolves the dependency closure for CPython 3.12 / manylinux x86_64: `pip download --no-deps
   --only-binary=:all:` one package at a time, reads the wheel's METADATA and follows its Requires-Dist
   with the markers evaluated for that platform. A package the image has by name is left out unless a
   staged package pins it to one release series (==, ~=X.Y.Z, >=X.Y.a,<X.(Y+1): torch's triton~=3.8.0,
   numba's llvmlite<0.48,>=0.47): the image's version is unknown, so a pin must be met by a staged wheel,
   while a range is taken to be met by the image's. Given a `pip freeze` of the image (--image-packages)
   instead, a package is left out exactly when the image's version meets every requirement on it.
   Packages in SKIP are left out as well (why: see SKIP).
2. writes <out>/manifest.json: every wheel with name, version, size and the requirements that pulled it
   in; the total size; what was skipped, left to the image, or had no wheel; and the parts;
3. packs the wheels into one tar, split byte-wise into <out>/partNN of at most --part-mib MiB each
   (<out> must be git-ignored; /.stage/ is added to .git/info/exclude);
4. prints the device commands that carry the parts over, one device call each, back to back.
Wheels already in <out>/wheels are reused, so a second run downloads nothing.

Usage (from the repository root):
    python3 hack/gpu-stage.py --vllm 0.33.0 [--torch auto] [--ray 2.60.0] [--out .stage/vllm-0.33.0]
                              [--part-mib N] [--pin NAME==VERSION ...] [--with REQUIREMENT ...] [--skip NAME ...]
                              [--image-packages FILE] [--kind nvidia-h200-x2]
    python3 hack/gpu-stage.py --vllm 0.33.0 --print-commands     # again, from the existing manifest

The TRL peer (benchmarks/trl_peer.py) needs a vLLM that both TRL 1.16.0 (vLLM 0.22-0.31) and the runtime
(vLLM >= 0.28) support; 0.28-0.31 all pin torch 2.13.0, so none uses the image's torch:
    python3 hack/gpu-stage.py --vllm 0.31.0 --with trl==1.16.0 --image-packages hack/gpu/image-freeze.txt

With the image's `pip freeze` (--image-packages hack/gpu/image-freeze.txt) the NVIDIA wheels the image already
has at the pinned versions are not staged. cuda-tile is staged: `flashinfer.comm`, which vLLM's expert-parallel
and all-reduce code import, needs it. Older vLLM may need pins, e.g. for 0.24:
    python3 hack/gpu-stage.py --vllm 0.24.0 --image-packages hack/gpu/image-freeze.txt --with trl==1.16.0 \
        --pin xgrammar==0.2.3 --pin apache-tvm-ffi==0.1.9 --pin nvidia-cudnn-frontend==1.32.0 \
        --skip flashinfer-cubin --skip cuda-tile
(xgrammar 0.2.8 needs a newer apache-tvm-ffi than vLLM 0.24 pins; flashinfer-cubin is not needed with
VLLM_USE_FLASHINFER_SAMPLER=0; cuda-tile would pull CUDA 13.4 compiler wheels that 0.24 never imports.)

A device call carries at most 64 MiB: the working tree (counted as a tar archive holds it, ``tree_mib``) plus one
part. Leave ``--part-mib`` out: it is computed from the tree.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = REPO.parent / "shared" / "gpu" / "gpu_image_packages.txt"

# Left out although something in the closure requires them. None of them is imported by `import vllm`
# or by serving a dense model on Hopper; each is imported only where its feature is used.
SKIP = {
    # CuTe-DSL (CUTLASS Python) kernels: FlashAttention 4 / SM100 FMHA, Blackwell and MoE-router kernels,
    # DeepSeek/Kimi decode kernels. vLLM imports `cutlass` only inside those modules. Its libs are large.
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (Blackwell FA4/MLA/MoE paths), imported only there",
    # TileLang kernels serve only DeepSeek's mHC (vllm.tilelang_utils, guarded by has_tilelang());
    # it also drags in z3-solver.
    "tilelang": "TileLang kernels for DeepSeek mHC only (has_tilelang())",
    # QuACK: CuTe-DSL kernels (needs nvidia-cutlass-dsl), imported only by those kernel modules.
    "quack-kernels": "CuTe-DSL kernels, imported only by their kernel modules",
    # TokenSpeed MLA attention backend (Blackwell, MLA models); drags in tokenspeed-triton, a triton fork.
    "tokenspeed-mla": "MLA attention backend for Blackwell, imported only when selected",
    # Kernels of the `humming` quantization method (has_humming()).
    "humming-kernels": "kernels of the humming quantization method (has_humming())",
    # Optional weight loaders (load_format=fastsafetensors / instanttensor); vLLM imports them in a try.
    "fastsafetensors": "optional loader (load_format=fastsafetensors), import guarded",
    "instanttensor": "optional loader (load_format=instanttensor), imported on use",
    # NVIDIA hardware video decoding for multimodal video inputs, imported on use.
    "pynvvideocodec": "hardware video decoding for video inputs, imported on use",
    # A metapackage (FlashInfer requires it) of cuda-bindings, cuda-core and cuda-pathfinder, which the
    # image has; its newest release would pin newer ones (cuda-bindings~=13.4.4) and shadow the image's.
    "cuda-python": "metapackage of cuda-bindings/cuda-core/cuda-pathfinder, which the image has",
}

# The GPU image's interpreter and platform, for `pip download` and for evaluating markers. Its Python is
# 3.12.3, Ubuntu 24.04's, so glibc 2.39. pip does not widen a given manylinux_2_N to older N: list them all
# (nvidia-nccl-cu13 2.30.7, for one, is tagged manylinux_2_18 only).
PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
MARKER_ENV = {
    "python_version": PYTHON, "python_full_version": PYTHON + ".3", "platform_machine": "x86_64",
    "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
}

# Exported on the device for every command that uses the staged vLLM; see ../shared/gpu/README.md.
# VLLM_USE_FLASHINFER_SAMPLER=0 still applies to 0.33: without flashinfer-cubin, FlashInfer's sampler
# tries to download kernels and the engine hangs.
DEVICE_ENV = ("PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 "
              "VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 NCCL_NVLS_ENABLE=0 "
              "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1")


class Wheel:
    """A downloaded wheel and the requirements in its METADATA."""

    def __init__(self, path: Path):
        self.path = path
        name, version, _, _ = parse_wheel_filename(path.name)
        self.name, self.version = str(name), version
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            text = z.read(meta).decode()
        self.requires = [Requirement(line.split(":", 1)[1].strip())
                         for line in text.splitlines() if line.startswith("Requires-Dist:")]


def pins_series(spec: SpecifierSet) -> bool:
    """Whether spec admits one X.Y release series at most: ==, ===, ~=X.Y.Z, or >=X.Y.a,<X.(Y+1)
    (torch 2.14: triton~=3.8.0; numba 0.65: llvmlite<0.48,>=0.47.0dev0)."""
    low = high = None
    for s in spec:
        if s.operator in ("==", "==="):
            return True
        release = Version(s.version.removesuffix(".*")).release
        if s.operator == "~=":
            low, high = release, (*release[:-2], release[-2] + 1)
        elif s.operator in (">=", ">"):
            low = release
        elif s.operator in ("<", "<="):
            high = release
    return bool(low and high) and high <= (low[0], (low + (0,))[1] + 1)


class Resolver:
    def __init__(self, wheel_dir: Path, image: dict[str, Version | None], pins: list[Requirement],
                 skip: dict[str, str] | None = None):
        self.wheel_dir = wheel_dir
        self.image = image
        self.skip = {**SKIP, **(skip or {})}
        self.pins = {canonicalize_name(p.name): p for p in pins}
        self.chosen: dict[str, Wheel] = {}
        self.missing: dict[str, str] = {}

    def resolve(self, roots: list[Requirement]) -> dict[str, list[tuple[str, str]]]:
        """Choose a wheel for every package reachable from roots. Each pass walks the graph of what is
        chosen so far and downloads what is new or no longer fits; it stops when nothing changes."""
        while True:
            wanted = self.walk(roots)
            changed = False
            for name, reasons in sorted(wanted.items()):
                if self.decision(name, reasons) != "stage" or name in self.missing:
                    continue
                spec = self.specifier(name, reasons)
                have = self.chosen.get(name)
                if have is None or not spec.contains(have.version, prereleases=True):
                    wheel = self.fetch(name, spec)
                    if wheel is None:
                        self.missing[name] = str(spec) or "any version"
                    else:
                        self.chosen[name] = wheel
                    changed = True
            if not changed:
                return wanted

    def walk(self, roots: list[Requirement]) -> dict[str, list[tuple[str, str]]]:
        """{package: [(requirement, required by)]} for everything reachable from roots through the
        wheels chosen so far, following each requested extra."""
        wanted: dict[str, list[tuple[str, str]]] = {}
        todo = [(r, "command line") for r in roots]
        done: set[tuple[str, str]] = set()
        while todo:
            req, by = todo.pop()
            name = canonicalize_name(req.name)
            reasons = wanted.setdefault(name, [])
            if (str(req), by) not in reasons:
                reasons.append((str(req), by))
            wheel = self.chosen.get(name)
            if wheel is None or self.decision(name, reasons) != "stage":
                continue
            for extra in ["", *sorted(req.extras)]:
                if (name, extra) in done:
                    continue
                done.add((name, extra))
                for dep in wheel.requires:
                    if extra and "extra" not in str(dep.marker):
                        continue  # a base dependency, followed with extra ""
                    if dep.marker is None or dep.marker.evaluate(dict(MARKER_ENV, extra=extra)):
                        todo.append((dep, f"{wheel.name} {wheel.version}"))
        return wanted

    def decision(self, name: str, reasons: list[tuple[str, str]]) -> str:
        """skip (in SKIP), image (left to the GPU image's own) or stage."""
        if name in self.skip:
            return "skip"
        if name not in self.image:
            return "stage"
        version = self.image[name]
        if version is not None:  # known from a `pip freeze` of the image: its version, if it fits (pins too)
            return "image" if self.specifier(name, reasons).contains(version, prereleases=True) else "stage"
        if name in self.pins:
            return "stage"
        # Only the name is known: a pin must be met by a staged wheel, a range is taken to be met.
        return "stage" if any(pins_series(Requirement(r).specifier) for r, _ in reasons) else "image"

    def specifier(self, name: str, reasons: list[tuple[str, str]]) -> SpecifierSet:
        if name in self.pins:
            return self.pins[name].specifier
        spec = SpecifierSet()
        for r, _ in reasons:
            spec &= Requirement(r).specifier
        return spec

    def fetch(self, name: str, spec: SpecifierSet) -> Wheel | None:
        """The newest wheel here that fits spec, else the one pip downloads; None if there is none."""
        def local() -> Wheel | None:
            fits = [(v, p) for p in self.wheel_dir.glob("*.whl")
                    for n, v, _, _ in [parse_wheel_filename(p.name)]
                    if n == name and spec.contains(v, prereleases=True)]
            return Wheel(max(fits)[1]) if fits else None

        if (wheel := local()) is not None:
            return wheel
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON, "--implementation", "cp", "-d", str(self.wheel_dir),
               *[a for p in PLATFORMS for a in ("--platform", p)], f"{name}{spec}"]
        print(f"  download {name}{spec}", flush=True)
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode:
            last = (result.stderr.strip().splitlines() or ["?"])[-1]
            print(f"  warning: no cp312 manylinux x86_64 wheel for {name}{spec}: {last}", file=sys.stderr)
            return None
        return local()


class PartWriter(io.RawIOBase):
    """A write-only file that spreads what is written over parts of at most `size` bytes each."""

    def __init__(self, out: Path, size: int, count_hint: int):
        self.out, self.size = out, size
        self.width = max(2, len(str(count_hint)))
        self.parts: list[Path] = []
        self.file = None
        self.left = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            if self.left == 0:
                self.close_part()
                self.parts.append(self.out / f"part{len(self.parts):0{self.width}d}")
                self.file = open(self.parts[-1], "wb")  # noqa: SIM115 (closed by close_part)
                self.left = self.size
            n = min(self.left, len(view))
            self.file.write(view[:n])
            view, self.left = view[n:], self.left - n
        return len(data)

    def close_part(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def image_packages(path: Path) -> dict[str, Version | None]:
    """{name: version or None} from a comma- or line-separated list of names, or `pip freeze` output."""
    image = {}
    for item in re.split(r"[,\n]", path.read_text()):
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?", item)
        if m:
            try:
                image[canonicalize_name(m[1])] = Version(m[2]) if m[2] else None
            except InvalidVersion:
                image[canonicalize_name(m[1])] = None
    return image


def torch_pin_of(vllm: Wheel) -> str:
    for req in vllm.requires:
        if canonicalize_name(req.name) == "torch" and req.marker is None:
            ops = [s for s in req.specifier if s.operator == "=="]
            if ops:
                return ops[0].version
    sys.exit(f"vllm {vllm.version} pins no torch==...; pass --torch VERSION")


def ensure_ignored(out: Path) -> None:
    exclude = Path(subprocess.check_output(["git", "rev-parse", "--git-path", "info/exclude"],
                                           cwd=REPO, text=True).strip())
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    if "/.stage/" not in text.split():
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + "/.stage/\n")
    if subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=REPO, check=False).returncode:
        sys.exit(f"{out} is not git-ignored: the device would carry it with every command; use .stage/...")


#: What one device call carries: the working tree (tracked and untracked-not-ignored files) plus the carried part.
DEVICE_CARRY_MIB = 64


def tar_bytes(size: int) -> int:
    """What one file of ``size`` bytes takes in a tar archive: a 512-byte header and its data in 512-byte blocks."""
    return 512 + -(-size // 512) * 512


def tree_mib() -> float:
    """MiB of the working tree a device call copies besides the carried part (git's tracked files and the
    untracked ones it does not ignore), counted as a tar archive holds them (``tar_bytes``): the device tool
    counts the archive, whose headers and padding add to the files' sizes."""
    names = subprocess.check_output(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                    cwd=REPO).split(b"\0")
    paths = (REPO / n.decode() for n in names if n)
    return sum(tar_bytes(p.stat().st_size) for p in paths if p.is_file()) / 2**20


def auto_part_mib(tree: float, limit: int = DEVICE_CARRY_MIB) -> int:
    """The largest whole-MiB part that fits one device call beside a working tree of ``tree`` MiB, with 1 MiB to
    spare for files written before the call (results, logs)."""
    part = int(limit - tree - 1)
    if part < 8:
        raise SystemExit(f"the working tree is {tree:.1f} MiB: too large to carry parts of a useful size beside it "
                         f"in one device call ({limit} MiB)")
    return part


def pack(wheels: list[Wheel], out: Path, part_mib: int) -> list[dict]:
    for old in out.glob("part*"):
        old.unlink()
    size = part_mib * 2**20
    total = sum(w.path.stat().st_size for w in wheels)
    writer = PartWriter(out, size, total // size + 1)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        for w in sorted(wheels, key=lambda w: w.path.name):
            tar.add(w.path, arcname=f"wheels/{w.path.name}")
    writer.close_part()
    return [{"file": p.name, "size": p.stat().st_size} for p in writer.parts]


def device_commands(manifest: dict, out: Path, kind: str) -> list[str]:
    rel = out.relative_to(REPO)
    site = f"/tmp/site-{manifest['vllm']}"
    # the bytecode compiled once, on every core, after the install: where PYTHONDONTWRITEBYTECODE is set (this
    # project's CPU machine sets it) Python never caches what it compiles, and every process then compiles torch,
    # vLLM and transformers from source at each import (`from vllm import LLM` takes several times as long).
    # -qq: a few files of the wheels do not compile (templates, tests)
    install = (f"cd /tmp/persist && cat part* | tar x && rm part* && rm -rf {site} && python3 -m pip install -q "
               f"--no-index --no-deps --no-compile --target {site} wheels/*.whl && "
               f"(python3 -m compileall -qq -j 0 {site} || true)")
    lines = []
    parts = [p["file"] for p in manifest["parts"]]
    for i, part in enumerate(parts):
        steps = [f"cp {rel}/{part} /tmp/persist/"]
        if i == 0:
            steps.insert(0, "rm -rf /tmp/persist && mkdir -p /tmp/persist")
        if i == len(parts) - 1:
            steps.append(install)
        head = f'kind="{kind}", ' if i == 0 else ""
        lines.append(f'run({head}carry=["{rel}/{part}"], command="{" && ".join(steps)}")')
    return lines


def print_commands(manifest: dict, out: Path, kind: str) -> None:
    site = f"/tmp/site-{manifest['vllm']}"
    print(f"\n{len(manifest['wheels'])} wheels, {manifest['total_size'] / 1e6:.0f} MB, "
          f"{len(manifest['parts'])} parts under {out.relative_to(REPO)}/.")
    print("Device commands, back to back (the machine stays warm only ~30 s after each; if it goes cold, "
          "start again from the first):")
    for line in device_commands(manifest, out, kind):
        print("  " + line)
    print("Sanity check:")
    print(f'  run(command="PYTHONPATH={site} python3 -c \\"import torch, vllm, ray; print(torch.__version__, '
          'torch.version.cuda, vllm.__version__, ray.__version__, torch.cuda.is_available())\\"")')
    print("Environment for every later command:")
    print(f"  export PYTHONPATH={site} {DEVICE_ENV}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", required=True, help="vLLM version to stage, e.g. 0.33.0")
    ap.add_argument("--torch", default="auto", help="torch version; auto: the one vLLM pins")
    ap.add_argument("--ray", default="2.60.0", help="Ray version to stage")
    ap.add_argument("--out", help="output folder (default .stage/vllm-<version>), under the repository")
    ap.add_argument("--part-mib", type=int, default=0,
                    help="largest part, MiB (default: what fits one device call, 64 MiB, beside the working tree)")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION",
                    help="force a version of any package in the closure (repeatable)")
    ap.add_argument("--with", dest="also", action="append", default=[], metavar="REQUIREMENT",
                    help="stage this package too, with its dependencies, e.g. trl==1.16.0 (repeatable)")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="leave this package out although something requires it (repeatable)")
    ap.add_argument("--image-packages", type=Path, default=IMAGE_PACKAGES,
                    help="what the GPU image has: names (versions unknown) or `pip freeze` output "
                         "(default: %(default)s)")
    ap.add_argument("--kind", default="nvidia-h200-x2", help="device kind named in the first command")
    ap.add_argument("--print-commands", action="store_true",
                    help="only print the device commands from the existing manifest")
    args = ap.parse_args()

    out = (REPO / (args.out or f".stage/vllm-{args.vllm}")).resolve()
    if not out.is_relative_to(REPO):
        sys.exit("--out must be inside the repository (device calls carry repository paths)")
    manifest_path = out / "manifest.json"
    if args.print_commands:
        print_commands(json.loads(manifest_path.read_text()), out, args.kind)
        return

    ensure_ignored(out)
    wheel_dir = out / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pins = [Requirement(p) for p in args.pin]
    resolver = Resolver(wheel_dir, image_packages(args.image_packages), pins,
                        {canonicalize_name(n): "--skip" for n in args.skip})

    vllm = resolver.fetch("vllm", SpecifierSet(f"=={args.vllm}"))
    if vllm is None:
        sys.exit(f"no wheel for vllm=={args.vllm}")
    torch = torch_pin_of(vllm) if args.torch == "auto" else args.torch
    roots = [Requirement(f"vllm=={args.vllm}"), Requirement(f"torch=={torch}"), Requirement(f"ray=={args.ray}"),
             *[Requirement(r) for r in args.also]]
    resolver.pins.setdefault("torch", roots[1])
    print(f"Resolving vllm {args.vllm}, torch {torch}, ray {args.ray} for CPython {PYTHON} manylinux x86_64")
    wanted = resolver.resolve(roots)

    staged, skipped, image, conflicts = [], [], [], []
    for name, reasons in sorted(wanted.items()):
        why = [{"requirement": r, "by": by} for r, by in reasons]
        decision = resolver.decision(name, reasons)
        if decision == "skip":
            skipped.append({"name": name, "reason": resolver.skip[name], "required_by": why})
        elif decision == "image":
            image.append({"name": name, "required_by": why})
        elif name in resolver.chosen:
            wheel = resolver.chosen[name]
            if not resolver.specifier(name, reasons).contains(wheel.version, prereleases=True):
                conflicts.append(f"{name} {wheel.version} does not meet {resolver.specifier(name, reasons)}")
            staged.append((wheel, why))
    missing = [{"name": n, "specifier": s, "required_by": [{"requirement": r, "by": by} for r, by in wanted[n]]}
               for n, s in sorted(resolver.missing.items()) if n in wanted]

    wheels = [w for w, _ in staged]
    if not args.part_mib:
        tree = tree_mib()
        args.part_mib = auto_part_mib(tree)
        print(f"Parts of {args.part_mib} MiB (the working tree is {tree:.1f} MiB; a device call carries "
              f"{DEVICE_CARRY_MIB})")
    parts = pack(wheels, out, args.part_mib)
    manifest = {
        "vllm": args.vllm, "torch": torch, "ray": args.ray, "with": args.also, "pins": args.pin,
        "skip": args.skip, "python": PYTHON, "platforms": PLATFORMS,
        "total_size": sum(w.path.stat().st_size for w in wheels),
        "wheels": [{"name": w.name, "version": str(w.version), "file": w.path.name,
                    "size": w.path.stat().st_size, "required_by": why} for w, why in staged],
        "skipped": skipped, "left_to_image": image, "missing": missing, "conflicts": conflicts,
        "part_mib": args.part_mib, "parts": parts,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")

    print(f"\nStaged {len(wheels)} wheels ({manifest['total_size'] / 1e6:.0f} MB); biggest:")
    for w in sorted(wheels, key=lambda w: -w.path.stat().st_size)[:15]:
        print(f"  {w.path.stat().st_size / 1e6:8.1f} MB  {w.name} {w.version}")
    print(f"Skipped (SKIP, --skip): {', '.join(s['name'] for s in skipped) or 'none'}")
    print(f"Left to the image: {', '.join(i['name'] for i in image) or 'none'}")
    for m in missing:
        print(f"MISSING (no wheel): {m['name']}{m['specifier']} required by "
              + ", ".join(f"{r['by']} ({r['requirement']})" for r in m["required_by"]))
    for c in conflicts:
        print(f"CONFLICT: {c}")
    print(f"Manifest: {manifest_path.relative_to(REPO)}")
    print_commands(manifest, out, args.kind)


if __name__ == "__main__":
    main()
