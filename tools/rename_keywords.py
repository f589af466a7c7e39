"""One-off migration (issue 25): labkit's renamed keywords in notebooks' code cells.

``timeout=`` -> ``timeout_s=`` and ``hang_timeout=`` -> ``hang_timeout_s=`` in calls of launch,
sweep, sbatch, slurm_status, try_load and every check_*; ``sweep(nprocs=)`` -> ``sweep(nproc=)``.
Other ``timeout=`` (torch's own, subprocess's) are left alone: only those calls' keywords change.
Markdown that names the old keywords is for a person to edit. Delete this file once applied::

    python tools/rename_keywords.py --write notebooks/*.ipynb solutions/*.ipynb
    python -m labkit.exercises generate
"""
import ast, json, sys
FUNCS = {"launch", "sweep", "sbatch", "slurm_status", "try_load", "launch_check", "launched", "attempt"}
RENAME = {"timeout": "timeout_s", "hang_timeout": "hang_timeout_s"}
def edit(src):
    try: tree = ast.parse(src)
    except SyntaxError: return src, 0   # %%writefile cells, magics
    lines = src.splitlines(keepends=True); edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call): continue
        f = node.func; name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name is None or (name not in FUNCS and not name.startswith("check_")): continue
        for kw in node.keywords:
            new = RENAME.get(kw.arg) or ("nproc" if kw.arg == "nprocs" and name == "sweep" else None)
            if new: edits.append((kw.lineno, kw.col_offset, kw.arg, new))
    for ln, col, old, new in sorted(edits, reverse=True):
        line = lines[ln-1]; assert line[col:col+len(old)] == old
        lines[ln-1] = line[:col] + new + line[col+len(old):]
    return "".join(lines), len(edits)
write = "--write" in sys.argv
for path in [a for a in sys.argv[1:] if a != "--write"]:
    nb = json.load(open(path)); total = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code": continue
        src = "".join(cell["source"])
        # IPython magics (%...) and shell lines (!...) are not Python: blank them for parsing
        masked = "\n".join(("#" + l[1:] if l.startswith(("%", "!")) else l) for l in src.split("\n"))
        new, n = edit(masked)
        if n:
            restored = "\n".join(o if o.startswith(("%", "!")) else m for o, m in zip(src.split("\n"), new.split("\n")))
            cell["source"] = restored.splitlines(keepends=True); total += n
    if total:
        print(f"{path}: {total} keyword(s)")
        if write:
            open(path, "w").write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
