"""Runs `ptxas -v` on every PTX file in a directory (`<file>.<sm_XY>.ptx`, assembled for sm_XY),
several at once, and prints one line per kernel function: registers, shared memory, stack frame
and spills, then a count per architecture. Exits 1 if anything spills or fails."""
import collections
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

ptxas, ptx_dir = sys.argv[1], pathlib.Path(sys.argv[2])
failed = False
rows = []
per_arch = collections.defaultdict(lambda: [0, 0, 0])  # kernels, failures, spills


def assemble(ptx):
    arch = ptx.stem.rsplit(".", 1)[1]
    return subprocess.run([ptxas, "-v", f"-arch={arch}", str(ptx), "-o", "/dev/null"],
                          capture_output=True, text=True)


files = sorted(ptx_dir.glob("*.ptx"))
with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    results = list(pool.map(assemble, files))
for ptx, r in zip(files, results):
    kernel, arch = ptx.stem.rsplit(".", 1)
    if r.returncode != 0:
        per_arch[arch][1] += 1
        print(f"FAILED ptxas {ptx}:\n{r.stderr}")
        failed = True
        continue
    func = props = None
    info = {}
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            func = m.group(1)
            info[func] = {}
        # "Function properties for F" names the function the next stack/spill line is about
        # (noinline device functions get their own, which must not overwrite the kernel's).
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            props = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props in info:
            info[props].update(stack=int(m[1]), spill_st=int(m[2]), spill_ld=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m and func:
            smem = re.search(r"(\d+) bytes smem", line)
            info[func].update(regs=int(m[1]), smem=int(smem[1]) if smem else 0)
    for func, i in info.items():
        spills = i.get("spill_st", 0) + i.get("spill_ld", 0)
        flag = "  SPILLS" if spills else ""
        failed |= spills > 0
        per_arch[arch][0] += 1
        per_arch[arch][2] += spills > 0
        rows.append(f"{arch:6} {func:44} regs {i.get('regs', '?'):>3}  smem {i.get('smem', 0):>6} B  "
                    f"stack {i.get('stack', 0):>4} B  spill st/ld {i.get('spill_st', 0)}/{i.get('spill_ld', 0)}{flag}")
print("\n".join(rows))
for arch in sorted(per_arch, key=lambda a: int(re.sub(r"\D", "", a))):
    k, f, sp = per_arch[arch]
    print(f"{arch:7} {k:4} kernels, {f} failed files, {sp} spilling")
print(f"ptxas report: {len(rows)} kernel functions, " + ("SPILLS OR FAILURES FOUND" if failed else "no spills"))
sys.exit(1 if failed else 0)
