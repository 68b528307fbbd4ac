"""The repository's import map in numbers: its Python files (tests and .venv left out), the arrows between them (a file
importing another of the repository's modules, function-level imports too), and each top folder's share of the lines.

    python -m benchmarks.checks.import_map [ROOT]      # a checkout (default: this one)

Before and after a restructuring, run on both checkouts (git worktree add /tmp/before <commit>)."""

import ast
import os
import sys
from collections import Counter


def python_files(root: str) -> list:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "tests", "__pycache__", "wandb")]
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    return sorted(found)


def module_name(path: str) -> str:
    name = path[: -len(".py")].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def arrows(root: str, files: list) -> set:
    modules = {module_name(p): p for p in files}
    edges = set()
    for path in files:
        package = module_name(path).rpartition(".")[0] if not path.endswith("__init__.py") else module_name(path)
        for node in ast.walk(ast.parse(open(os.path.join(root, path)).read())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(filter(None, [package if node.level else "", node.module]))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                if name in modules and modules[name] != path:
                    edges.add((path, modules[name]))
    return edges


def main(root: str) -> None:
    files = python_files(root)
    lines = {p: len(open(os.path.join(root, p)).read().splitlines()) for p in files}
    folders = Counter()
    for p, n in lines.items():
        folders[p.split(os.sep)[0] if os.sep in p else "(root)"] += n
    total = sum(lines.values())
    biggest, size = folders.most_common(1)[0]
    print(
        f"{len(files)} files, {len(arrows(root, files))} arrows, {total} lines; largest folder {biggest}/ "
        f"{size / total:.0%} ({', '.join(f'{k} {v / total:.0%}' for k, v in folders.most_common())})"
    )


if __name__ == "__main__":
    main(
        os.path.abspath(
            sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        )
    )
