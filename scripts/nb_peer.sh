#!/usr/bin/env bash
# Prepares .nbpeer/: what the H200 machine (Python 3.12, no network) needs to
# execute examples/quickstart.ipynb headlessly: nbclient + ipykernel (the
# Jupyter stack) and matplotlib, as wheels. Run it here, from the project root:
#
#     scripts/nb_peer.sh              # writes .nbpeer/ (git-ignored via .git/info/exclude)
#     scripts/nb_peer.sh --selftest   # also proves the wheels complete: a fresh Python 3.12
#                                     # venv with only numpy, then the H200 install + a notebook run
#
# Take .nbpeer/ along to the H200 machine (device tool: carry [".nbpeer"]) and run
#
#     source .nbpeer/activate.sh; python3 scripts/run_notebook.py examples/quickstart.ipynb OUT.ipynb
#
# (scripts/gpu_run.sh OUT notebook does exactly that). activate.sh installs, with
# `pip install --no-index --no-deps --target /tmp/nbpeer`, only the wheels whose module
# does not import there (or is too old for the others), then puts /tmp/nbpeer first on
# PYTHONPATH and PATH and registers the `python3` kernel spec under /tmp/nbpeer.
#
# Kept small for the device tool's 64 MiB of carried folders (.peer/ is ~39 MiB):
# every wheel is downloaded with --no-deps from the pinned list below; left out are
# what the H200 already has (numpy) and what the notebook run never imports (debugpy:
# the debugger; jedi/parso: tab completion; tzdata: dateutil falls back to the system's
# zoneinfo). matplotlib, pillow and fonttools are re-zipped without their tests, sample
# data, unused fonts, image codecs (PNG stays) and Cython speedups (pure twins stay).
set -euo pipefail
selftest=0
usage="usage: scripts/nb_peer.sh [--selftest]

Downloads, into .nbpeer/, the wheels a Python 3.12 machine without network
access needs to execute examples/quickstart.ipynb headless (nbclient,
ipykernel, matplotlib), and writes .nbpeer/activate.sh, which installs them
there. --selftest also installs them in a fresh Python 3.12 environment and
runs a small plotting notebook and the quickstart without its GPU cells."
case ${1:-} in
  -h|--help) echo "$usage"; exit 0 ;;
  --selftest) selftest=1 ;;
  "") ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.nbpeer/' .git/info/exclude 2>/dev/null || echo '/.nbpeer/' >> .git/info/exclude
rm -rf .nbpeer
mkdir -p .nbpeer/whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any)
# Pinned: the set tested together (scripts/nb_peer.sh --selftest). wcwidth 0.2.13 is the
# pure-Python one (0.3+ ship a compiled table, 25x larger); prompt_toolkit needs only wcwidth().
wheels=(
  # run the notebook: nbclient drives a kernel over ZeroMQ and writes nbformat
  nbclient==0.11.0 nbformat==5.11.1 fastjsonschema==2.22.3 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
  jupyter-client==8.10.0 jupyter-core==5.9.1 platformdirs==4.14.8 traitlets==5.16.1
  python-dateutil==4.0.0 pyzmq==27.3.0 tornado==6.6.1 typing-extensions==4.16.0
  # the kernel
  ipykernel==7.4.0 comm==0.2.3 ipython==9.18.1 ipython-pygments-lexers==1.1.1 pygments==2.21.0
  prompt-toolkit==3.0.53 wcwidth==0.2.13 pexpect==4.9.0 ptyprocess==0.7.0 psutil==7.2.2
  stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
  matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 packaging==26.4
  # the plot (numpy: the H200 has 2.x)
  matplotlib==3.11.2 pillow==13.0.0 contourpy==1.4.0 cycler==0.12.1 kiwisolver==1.5.1
  pyparsing==3.3.3 fonttools==4.68.0
)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/dl" "${wheels[@]}"

# Slim matplotlib, pillow and fonttools, copy the rest; write the manifest (wheel, dist, version, module).
python3 - "$tmp/dl" .nbpeer <<'PY'
import base64, fnmatch, hashlib, os, re, shutil, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
DROP = {
    "matplotlib": [
        "matplotlib/tests/*", "mpl_toolkits/*/tests/*", "matplotlib/mpl-data/sample_data/*",
        "matplotlib/backends/web_backend/*", "matplotlib/backends/_tkagg*", "matplotlib/mpl-data/images/*",
        # PS/PDF core fonts; of the TrueType fonts keep DejaVu Sans (the default), STIX and
        # Computer Modern (mathtext) and the last-resort fallback.
        "matplotlib/mpl-data/fonts/afm/*", "matplotlib/mpl-data/fonts/pdfcorefonts/*",
        "matplotlib/mpl-data/fonts/ttf/DejaVuSansMono*", "matplotlib/mpl-data/fonts/ttf/DejaVuSerif*",
    ],
    # keep PIL._imaging (+ the libraries it links: tiff, jpeg, openjpeg, xcb) for PNG
    "pillow": [
        "PIL/_avif*", "PIL/_webp*", "PIL/_imagingft*", "PIL/_imagingcms*",
        "pillow.libs/libavif*", "pillow.libs/libwebp*", "pillow.libs/libsharpyuv*",
        "pillow.libs/libharfbuzz*", "pillow.libs/libfreetype*", "pillow.libs/libpng*",
        "pillow.libs/libbrotli*", "pillow.libs/liblcms2*",
    ],
    # matplotlib imports fontTools.agl (dviread) and, for PDF/PS, ttLib/subset; the
    # Cython-compiled speedups (80 % of the wheel) have pure-Python twins
    "fonttools": ["fontTools/*.so", "fontTools/*.c"],
}


def record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim(path, out, patterns):
    """Re-zip the wheel without the members matching patterns; RECORD rewritten."""
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in zin.infolist():
            name = info.filename
            if name == record_name or any(fnmatch.fnmatch(name, p) for p in patterns):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            if not name.endswith("/"):
                rows.append((name, record_hash(data), str(len(data))))
        rows.append((record_name, "", ""))
        text = "".join(",".join(r) + "\n" for r in rows)
        zout.writestr(zin.getinfo(record_name), text)


def top_module(path, dist):
    """The module to import-test: the wheel's top-level package (or module) named most like it."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    tops = set()
    for n in names:
        head, _, rest = n.partition("/")
        if head.endswith((".dist-info", ".data", ".libs")):
            continue
        if rest == "__init__.py":
            tops.add(head)
        elif not rest and (head.endswith(".py") or head.endswith(".so")):
            tops.add(head.split(".")[0])
    key = re.sub(r"[-_.]+", "", dist.lower())
    for t in sorted(tops):
        if re.sub(r"[-_.]+", "", t.lower()) == key:
            return t
    return sorted(t for t in tops if not t.startswith("_"))[0]


manifest = []
for fn in sorted(os.listdir(src)):
    dist, version = fn.split("-")[:2]
    canon = re.sub(r"[-_.]+", "-", dist).lower()
    out = os.path.join(dst, "whl", fn)
    if canon in DROP:
        slim(os.path.join(src, fn), out, DROP[canon])
    else:
        shutil.copy(os.path.join(src, fn), out)
    module = {"pyzmq": "zmq", "pillow": "PIL", "python-dateutil": "dateutil", "rpds-py": "rpds"}.get(canon) \
        or top_module(out, canon)
    manifest.append((fn, canon, version, module))
with open(os.path.join(dst, "manifest.tsv"), "w") as f:
    f.write("# wheel\tdistribution\tversion\tmodule (import-tested on the H200)\n")
    f.writelines("\t".join(row) + "\n" for row in manifest)
PY

cat > .nbpeer/install.py <<'PY'
"""Run by activate.sh with the H200's python3: install into TARGET, from the wheels
beside this file, those whose module does not import here or whose installed version
does not satisfy the requirements of the wheels that will be used (a small fixpoint),
then check that nbclient, ipykernel and matplotlib import, and write the kernel spec
"python3" (this interpreter) into TARGET/share/jupyter. Usage: install.py TARGET"""
import json, os, subprocess, sys, zipfile
from email.parser import Parser

here = os.path.dirname(os.path.abspath(__file__))
target = sys.argv[1]
rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(here, "manifest.tsv")) if not line.startswith("#")]
wheels = {dist: (os.path.join(here, "whl", fn), version, module) for fn, dist, version, module in rows}
ROOTS = ["nbclient>=0.7", "nbformat>=5.2", "ipykernel>=6.0", "matplotlib>=3.5", "matplotlib-inline>=0.1"]
CHECK = ("import nbclient, nbformat, jupyter_client, ipykernel.kernelapp, IPython, zmq, "
         "matplotlib, matplotlib.pyplot, matplotlib_inline.backend_inline, PIL.PngImagePlugin")

# 1. what imports here, and at which version, without TARGET on the path
probe = r"""
import importlib, importlib.metadata as md, json, sys
res = {}
for dist, module in json.loads(sys.argv[1]).items():
    try:
        importlib.import_module(module)
    except BaseException as e:
        res[dist] = None
        continue
    try:
        res[dist] = md.version(dist)
    except Exception:
        res[dist] = ""
print(json.dumps(res))
"""
env = dict(os.environ)
env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                    if p and os.path.abspath(p) != os.path.abspath(target))
env["MPLBACKEND"] = "Agg"
out = subprocess.run([sys.executable, "-c", probe, json.dumps({d: w[2] for d, w in wheels.items()})],
                     env=env, capture_output=True, text=True, check=True).stdout
have = json.loads(out.strip().splitlines()[-1])

# 2. packaging from its wheel (zipimport) to read requirements; chosen = wheels to install
sys.path.insert(0, wheels["packaging"][0])
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402


def requires(dist):
    with zipfile.ZipFile(wheels[dist][0]) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def satisfied(req):
    name = canonicalize_name(req.name)
    if name not in wheels or name in chosen:
        return True  # not ours to provide (numpy), or ours is chosen (the pins fit)
    v = have.get(name)
    if v is None:
        return False
    return v == "" or req.specifier.contains(Version(v), prereleases=True)


chosen = {d for d, v in have.items() if v is None}
while True:
    reqs = [Requirement(r) for r in ROOTS] + [r for d in sorted(chosen) for r in requires(d)]
    more = {canonicalize_name(r.name) for r in reqs if not satisfied(r)}
    if not more - chosen:
        break
    chosen |= more


def install(dists):
    files = [wheels[d][0] for d in sorted(dists)]
    if not files:
        return
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--disable-pip-version-check", "--target", target, *files],
                       capture_output=True, text=True)
    if r.returncode != 0:  # no pip, or one too old for these wheels: unzip them (what pip does here)
        print(f"nbpeer: pip failed ({r.stderr.strip().splitlines()[-1:]}); unzipping the wheels", file=sys.stderr)
        for f in files:
            with zipfile.ZipFile(f) as z:
                for name in z.namelist():
                    parts = name.split("/")
                    if len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
                        dest = os.path.join(target, *parts[2:])
                    elif parts[0].endswith(".data"):
                        continue
                    else:
                        dest = os.path.join(target, name)
                    if name.endswith("/"):
                        continue
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with open(dest, "wb") as fh:
                        fh.write(z.read(name))


def check():
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([target] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True)


os.makedirs(target, exist_ok=True)
install(chosen)
r = check()
if r.returncode != 0:  # a mix of the machine's packages and ours that does not work: take all of ours
    print(f"nbpeer: {r.stderr.strip().splitlines()[-1:]} with the machine's packages; installing every wheel",
          file=sys.stderr)
    chosen = set(wheels)
    install(chosen)
    r = check()
# the kernel spec "python3": this interpreter (ipykernel install --prefix may write a bare "python")
spec_dir = os.path.join(target, "share", "jupyter", "kernels", "python3")
os.makedirs(spec_dir, exist_ok=True)
with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
    json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
               "display_name": "Python 3 (ipykernel)", "language": "python",
               "metadata": {"debugger": False}}, f, indent=1)
print(f"nbpeer: installed {len(chosen)} of {len(wheels)} wheels into {target}"
      + (f" ({', '.join(sorted(chosen))})" if chosen else ""), file=sys.stderr)
if r.returncode != 0:
    sys.exit(f"nbpeer: still failing: {r.stderr.strip()}")
PY

cat > .nbpeer/activate.sh <<'EOF'
# source this on the H200 machine (from the project root): makes nbclient, ipykernel and
# matplotlib importable for python3 (installing into /tmp/nbpeer what is missing there,
# once) and registers the kernel spec "python3" (this python3 + ipykernel) under
# /tmp/nbpeer/share/jupyter, first on JUPYTER_PATH.
_nbp=${NBPEER_TARGET:-/tmp/nbpeer}
_nbp_src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f "$_nbp/.ready" ]; then
  python3 "$_nbp_src/install.py" "$_nbp" && touch "$_nbp/.ready"
fi
export PYTHONPATH=$_nbp${PYTHONPATH:+:$PYTHONPATH}
export PATH=$_nbp/bin:$PATH
export JUPYTER_PATH=$_nbp/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
export JUPYTER_PLATFORM_DIRS=1 JUPYTER_RUNTIME_DIR=$_nbp/runtime IPYTHONDIR=$_nbp/ipython
export PYDEVD_DISABLE_FILE_VALIDATION=1
unset _nbp _nbp_src
EOF
du -sh .nbpeer
echo "ready: take .nbpeer/ along (carry [\".nbpeer\"]) and begin the H200 command with 'source .nbpeer/activate.sh;'"

if [ "$selftest" = 1 ]; then
  # The H200 in miniature: Python 3.12 with numpy and ml_dtypes only (no Jupyter stack, no
  # matplotlib, no CUDA); install from .nbpeer/ into a scratch target, then execute a small
  # notebook that plots, and the quickstart without its gpu cells.
  py=${PY312:-}
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -z "$py" ] && "$c" --version >/dev/null 2>&1 && py=$c
  done
  [ -n "$py" ] || { echo "selftest: no working python3.12 here (set PY312=/path/to/python3.12)" >&2; exit 1; }
  echo "selftest with $py"
  "$py" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -q numpy ml_dtypes
  cat > "$tmp/t.ipynb" <<'EOF'
{"cells": [
 {"cell_type": "code", "execution_count": null, "id": "a", "metadata": {}, "outputs": [],
  "source": ["import numpy as np, matplotlib.pyplot as plt\n", "print('sum', np.arange(4).sum())"]},
 {"cell_type": "code", "execution_count": null, "id": "b", "metadata": {}, "outputs": [],
  "source": ["fig, ax = plt.subplots(figsize=(3, 2)); ax.plot([1, 2], [3, 4], marker='o', label='x')\n",
             "ax.set_xscale('log', base=2); ax.set_title('t\\nu'); ax.legend(); plt.show()"]}],
 "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
 "nbformat": 4, "nbformat_minor": 5}
EOF
  (
    export PATH="$tmp/venv/bin:$PATH" NBPEER_TARGET="$tmp/nbpeer"
    unset PYTHONPATH JUPYTER_PATH MPLBACKEND
    source .nbpeer/activate.sh
    python3 scripts/run_notebook.py "$tmp/t.ipynb" "$tmp/t.out.ipynb" --timeout 120
    mkdir "$tmp/examples"
    python3 -c 'import json, sys; nb = json.load(open(sys.argv[1]))
nb["cells"] = [c for c in nb["cells"] if "gpu" not in c["metadata"].get("tags", [])]
json.dump(nb, open(sys.argv[2], "w"))' examples/quickstart.ipynb "$tmp/examples/q.ipynb"
    python3 scripts/run_notebook.py "$tmp/examples/q.ipynb" "$tmp/examples/q.out.ipynb" --timeout 120
  )
  echo "selftest: ok"
fi
