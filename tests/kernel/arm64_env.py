"""The arm64 kernel tests' harness: Debian's arm64 cloud kernel and busybox, QEMU's virt machine.

- obtain_arm64_kernel(): the current ``linux-image-<release>-cloud-arm64-unsigned`` (apt-get
  download of the :arm64 package; apt needs the arm64 lists: ``dpkg --add-architecture arm64 &&
  apt-get update``, which .ci/run does), its boot/ files extracted once per version into the kernel
  cache (kernel_env.cache_dir()/arm64/).  Its vmlinuz is an uncompressed arm64 Image.
- arm64_busybox(): Debian's busybox-static:arm64, extracted into the same cache.
- build_initramfs(): kernel_env's, with that busybox (its applets listed under qemu-aarch64).
- boot(): qemu-system-aarch64 -M virt -cpu max (pointer authentication on; KASLR seeded by the
  CPU's RNDR), the PL011 console captured.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import kernel_env
from kernel_env import KernelEnvError, _extract_boot, _locked, _run

META_PACKAGE = "linux-image-cloud-arm64:arm64"
QEMU_SYSTEM = "qemu-system-aarch64"
DEFAULT_APPEND = "console=ttyAMA0 panic=-1"
WX_PASSED = "Checked W+X mappings: passed"


def _root() -> Path:
    d = kernel_env.cache_dir() / "arm64"
    d.mkdir(parents=True, exist_ok=True)
    return d


def current_package() -> tuple[str, str, str]:
    r = _run(["apt-cache", "depends", META_PACKAGE])
    m = re.search(r"Depends:\s*linux-image-(\S+-cloud-arm64)\b", r.stdout)
    if r.returncode != 0 or not m:
        raise KernelEnvError(f"apt does not know {META_PACKAGE} ({(r.stderr or r.stdout).strip() or 'no Depends'}); "
                             "run `dpkg --add-architecture arm64 && apt-get update` (.ci/run does)")
    release = m.group(1)
    package = f"linux-image-{release}-unsigned"
    r = _run(["apt-cache", "policy", f"{package}:arm64"])
    m = re.search(r"Candidate:\s*(\S+)", r.stdout)
    if r.returncode != 0 or not m or m.group(1) == "(none)":
        raise KernelEnvError(f"apt has no candidate for {package}:arm64; run `apt-get update` (.ci/run does)")
    return package, m.group(1), release


class Arm64Kernel:
    def __init__(self, d: Path):
        self.dir = d
        self.meta = json.loads((d / "meta.json").read_text())
        self.package, self.version, self.release = self.meta["package"], self.meta["version"], self.meta["release"]
        self.vmlinuz = d / self.meta["vmlinuz"]
        self.config = d / self.meta["config"]
        self.system_map = d / self.meta["system_map"]

    def config_value(self, name: str) -> str | None:
        for line in self.config.read_text().splitlines():
            if line.startswith(name + "="):
                return line.split("=", 1)[1]
        return None


def env(fn, *a):
    """fn(*a), a failure of the test environment (no package, no QEMU) failing the test in one
    line, as the kernel tests' fixtures do."""
    try:
        return fn(*a)
    except KernelEnvError as e:
        import pytest
        pytest.fail(f"arm64 kernel test environment: {e}", pytrace=False)


def _download(spec: str, work: Path) -> Path:
    r = _run(["apt-get", "download", "-q", spec], cwd=work)
    debs = list(work.glob("*.deb"))
    if r.returncode != 0 or len(debs) != 1:
        raise KernelEnvError(f"apt-get download {spec} failed: "
                             f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no .deb']}")
    return debs[0]


def obtain_arm64_kernel() -> Arm64Kernel:
    """The current Debian arm64 cloud kernel, downloaded once per version into the cache;
    offline, the newest one already there."""
    root = _root()
    try:
        package, version, release = current_package()
    except KernelEnvError as e:
        cached = sorted(p.parent for p in root.glob("linux-image-*/meta.json"))
        if cached:
            return Arm64Kernel(cached[-1])
        raise KernelEnvError(f"cannot obtain the Debian arm64 cloud kernel: {e}")
    final = root / f"{package}_{version}"
    with _locked(root / ".lock"):
        if (final / "meta.json").exists():
            return Arm64Kernel(final)
        work = Path(tempfile.mkdtemp(prefix=".dl-", dir=root))
        try:
            deb = _download(f"{package}:arm64={version}", work)
            names = _extract_boot(deb, work, release)
            deb.unlink()
            meta = {"package": package, "version": version, "release": release, **names}
            (work / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            work.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return Arm64Kernel(final)


def obtain_dbg_vmlinux(k: Arm64Kernel) -> Path:
    """The ELF vmlinux of the same kernel, from Debian's linux-image-<release>-dbg (262 MB; only
    the vmlinux is kept), downloaded once into the kernel's cache folder."""
    out = k.dir / f"vmlinux-{k.release}"
    with _locked(_root() / ".lock"):
        if out.exists():
            return out
        work = Path(tempfile.mkdtemp(prefix=".dbg-", dir=_root()))
        try:
            deb = _download(f"linux-image-{k.release}-dbg:arm64={k.version}", work)
            member = f"./usr/lib/debug/boot/vmlinux-{k.release}"
            r = _run(["sh", "-c", f"dpkg-deb --fsys-tarfile '{deb}' | tar -x -C '{work}' '{member}'"])
            if r.returncode != 0 or not (work / member).exists():
                raise KernelEnvError(f"{deb.name}: no {member} ({r.stderr.strip()[-200:]})")
            (work / member).rename(out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def obtain_arm64_modules(k: Arm64Kernel, rels: list[str]) -> list[Path]:
    """lib/modules/<release>/<rel> of the kernel's package for each rel, extracted once into its
    cache folder (modules/<rel>; the package fetched again with apt-get download: the cache keeps
    only boot/ files otherwise)."""
    dests = [k.dir / "modules" / rel for rel in rels]
    if all(d.exists() for d in dests):
        return dests
    with _locked(_root() / ".lock"):
        missing = [(rel, d) for rel, d in zip(rels, dests) if not d.exists()]
        if not missing:
            return dests
        work = Path(tempfile.mkdtemp(prefix=".mod-", dir=_root()))
        try:
            deb = _download(f"{k.package}:arm64={k.version}", work)
            for rel, dest in missing:
                member = f"./lib/modules/{k.release}/{rel}"
                r = subprocess.run(f"dpkg-deb --fsys-tarfile '{deb}' | tar -xO '{member}'", shell=True,
                                   capture_output=True)
                if r.returncode != 0 or not r.stdout.startswith(b"\x7fELF"):
                    raise KernelEnvError(f"{deb.name} has no {member}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_suffix(".tmp")
                tmp.write_bytes(r.stdout)
                tmp.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dests


def obtain_arm64_symvers(k: Arm64Kernel) -> Path:
    """The kernel's Module.symvers (its exported symbols' CRCs, for a module's __versions), from
    Debian's linux-headers-<release>:arm64 of the same version (1.5 MB), once into the kernel's
    cache folder."""
    dest = k.dir / "Module.symvers"
    with _locked(_root() / ".lock"):
        if dest.exists():
            return dest
        work = Path(tempfile.mkdtemp(prefix=".hdr-", dir=_root()))
        try:
            deb = _download(f"linux-headers-{k.release}:arm64={k.version}", work)
            member = f"./usr/src/linux-headers-{k.release}/Module.symvers"
            r = subprocess.run(f"dpkg-deb --fsys-tarfile '{deb}' | tar -xO '{member}'", shell=True, capture_output=True)
            if r.returncode != 0 or not r.stdout.startswith(b"0x"):
                raise KernelEnvError(f"{deb.name} has no {member}")
            tmp = dest.with_suffix(".tmp")
            tmp.write_bytes(r.stdout)
            tmp.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def arm64_busybox() -> Path:
    """Debian's busybox-static for arm64 (bin/busybox), fetched once."""
    root = _root()
    exe = root / "busybox" / "busybox"
    with _locked(root / ".lock"):
        if exe.exists():
            return exe
        work = Path(tempfile.mkdtemp(prefix=".bb-", dir=root))
        try:
            deb = _download("busybox-static:arm64", work)
            r = _run(["dpkg-deb", "-x", str(deb), str(work / "x")])
            if r.returncode != 0 or not (work / "x/bin/busybox").exists():
                raise KernelEnvError(f"{deb.name}: no bin/busybox ({r.stderr.strip()})")
            exe.parent.mkdir(exist_ok=True)
            shutil.copyfile(work / "x/bin/busybox", exe)
            exe.chmod(0o755)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return exe


def build_initramfs(init: str, extra=None) -> Path:
    runner = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if runner is None:
        raise KernelEnvError("qemu-aarch64 not found: install Debian's qemu-user (busybox's applets are listed by it)")
    return kernel_env.build_initramfs(init, extra, dest_dir=_root() / "initramfs", busybox=arm64_busybox(),
                                      runner=(runner,))


AAVMF = Path("/usr/share/AAVMF")


def boot(kernel, initrd, *, cpu: str = "max", smp: int = 2, memory: int = 1024, append: str = DEFAULT_APPEND,
         extra_append: str = "", timeout: float = 180, log: Path | None = None,
         uefi: bool = False, qemu_args: tuple[str, ...] = ()) -> kernel_env.BootResult:
    """qemu-system-aarch64 -M virt -cpu <cpu> with -kernel (QEMU loads the Image at a 2 MiB
    boundary; the kernel randomizes its own base: KASLR).  uefi: through the firmware of
    Debian's qemu-efi-aarch64 (AAVMF, as pflash), which starts the Image through its PE header
    and the kernel's EFI stub.  qemu_args: more options (e.g. -icount)."""
    args = ["-M", "virt", "-cpu", cpu]
    with tempfile.TemporaryDirectory(prefix="kprewrite-uefi-") as work:
        if uefi:
            code, vars_ = AAVMF / "AAVMF_CODE.fd", AAVMF / "AAVMF_VARS.fd"
            if not code.exists() or not vars_.exists():
                raise KernelEnvError(f"no {code}: install Debian's qemu-efi-aarch64")
            shutil.copyfile(vars_, Path(work) / "vars.fd")
            args += ["-drive", f"if=pflash,format=raw,readonly=on,file={code}",
                     "-drive", f"if=pflash,format=raw,file={Path(work) / 'vars.fd'}"]
        return kernel_env.boot(kernel, initrd, smp=smp, memory=memory, append=append, extra_append=extra_append,
                               timeout=timeout, log=log, qemu_system=QEMU_SYSTEM, qemu_args=(*args, *qemu_args))


if __name__ == "__main__":
    t0 = time.monotonic()
    k = obtain_arm64_kernel()
    print(k.package, k.version, k.vmlinuz, f"{time.monotonic() - t0:.1f} s")
    rd = build_initramfs(kernel_env.init_script("cat /proc/version"))
    r = boot(k.vmlinuz, rd)
    print(r.tail(8), f"\n{r.seconds:.1f} s")
