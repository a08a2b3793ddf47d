"""Follow a run's config through the static call graph and count how often the walk climbs
a layer or comes back to a file it had left.

From `dorarl.jobs.ray_run.run_ray` (or `--start module:function`), with its `config`
parameter tracked, the walk enters every dorarl function or class a tracked value is
passed to, depth first in the order Python evaluates the calls (a call's arguments before
it), each function once. A tracked value is the config,
an expression that reads one (`config.ray.address`), or a name or `self` attribute assigned
from one (`point = config.resume_point()`): values derived from the config that are
passed on. The result of a dorarl call is derived when it is a dataclass built from
tracked values (a plan, a spec: the config's data carried on), not when it is an object
with behaviour (a task, a runtime). A tracked receiver counts as an argument
(`config.transport()` passes the config to `TrainConfig.transport`). Calls are resolved through imports, parameter and
return annotations, and constructor assignments (`x = Cls(...)`, `self.x = Cls(...)`);
what cannot be resolved statically (a callable in a variable, a Ray remote) is not
followed.

The walk's files, in the order it enters them (a file entered twice in a row counted
once), give the two figures: a climb is a step from a file of a lower layer to one of a
higher layer (the layers of tests/test_layering.py); a return is a step into a file the
walk had been in before. Usage: python scripts/config_walk.py [--start M:F] [--param P]
[--trail]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_layering import layer_of, modules  # noqa: E402  (the layers the tests enforce)


@dataclass
class ClassInfo:
    module: str
    name: str
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    attr_types: dict[str, str] = field(default_factory=dict)  # self.x -> class qualname


@dataclass
class ModuleInfo:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified name
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """A callee: a function (`cls` set for a method) or a class without `__init__`."""

    module: str
    qualname: str
    node: ast.FunctionDef | None
    cls: str | None = None  # qualified class name of a method, or of the class made
    bound: bool = False  # called on an instance or a class: the first parameter is bound


def _index() -> dict[str, ModuleInfo]:
    index = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        info = ModuleInfo(name, path, tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + [base])
                for alias in node.names:
                    info.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    info.imports[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                cls = ClassInfo(name, node.name, node)
                cls.bases = [ast.unparse(b) for b in node.bases]
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        cls.methods[item.name] = item
                info.classes[node.name] = cls
        index[name] = info
    return index


class Walk:
    def __init__(self, index: dict[str, ModuleInfo]) -> None:
        self.index = index
        self.seen: set[str] = set()
        self.trail: list[tuple[str, str]] = []  # (module, qualname) in the order entered
        self._typing: set[str] = set()  # classes whose attribute types are being read
        self.returns: Tracked = {}  # walked function -> what of the tracked it returns

    # ---- names to definitions ----------------------------------------------------------
    def lookup(self, module: str, name: str) -> str | None:
        """The qualified name `name` means in `module` (a function, class or module)."""
        info = self.index.get(module)
        if info is None:
            return None
        if name in info.functions or name in info.classes:
            return f"{module}.{name}"
        target = info.imports.get(name)
        if target is None:
            return None
        return self._canonical(target)

    def _canonical(self, qualified: str, depth: int = 0) -> str | None:
        """Follow re-exports (`from dorarl.driver import Driver`) to the defining module."""
        if qualified in self.index:
            return qualified
        module, _, name = qualified.rpartition(".")
        info = self.index.get(module)
        if info is None or depth > 5:
            return None
        if name in info.functions or name in info.classes:
            return qualified
        if name in info.imports:
            return self._canonical(info.imports[name], depth + 1)
        return None

    def cls_of(self, qualified: str | None) -> ClassInfo | None:
        if qualified is None:
            return None
        module, _, name = qualified.rpartition(".")
        info = self.index.get(module)
        return info.classes.get(name) if info else None

    def method(self, cls: ClassInfo, name: str) -> tuple[ClassInfo, ast.FunctionDef] | None:
        """`name` on `cls` or the first dorarl base that defines it."""
        if name in cls.methods:
            return cls, cls.methods[name]
        for parent in self.parents(cls):
            found = self.method(parent, name)
            if found:
                return found
        return None

    def parents(self, cls: ClassInfo) -> Iterator[ClassInfo]:
        """The dorarl classes `cls` derives from directly, in base order."""
        for base in cls.bases:
            parent = self.cls_of(self.lookup(cls.module, base.split("[")[0]))
            if parent is not None:
                yield parent

    def annotation_class(self, module: str, annotation: ast.expr | None) -> str | None:
        """The dorarl class an annotation names (`X`, `X | None`, `"X"`)."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp):  # X | None
            return self.annotation_class(module, annotation.left) or self.annotation_class(
                module, annotation.right
            )
        if isinstance(annotation, ast.Name):
            found = self.lookup(module, annotation.id)
            return found if self.cls_of(found) else None
        if isinstance(annotation, ast.Attribute):
            return self._dotted_class(module, annotation)
        return None

    def _dotted_class(self, module: str, node: ast.Attribute) -> str | None:
        text = ast.unparse(node)
        head, _, rest = text.partition(".")
        base = self.lookup(module, head)
        if base is None:
            return None
        found = self._canonical(f"{base}.{rest}")
        return found if self.cls_of(found) else None

    # ---- types of values -----------------------------------------------------------------
    def _attr_types(self, info: ModuleInfo, cls: ClassInfo) -> dict[str, str]:
        types: dict[str, str] = {}
        for item in cls.node.body:  # dataclass fields
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found = self.annotation_class(info.name, item.annotation)
                if found:
                    types[item.target.id] = found
        for fn in cls.methods.values():
            params = self._param_types(info.name, fn)
            for node in ast.walk(fn):
                targets, value, annotation = _assignment(node)
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        found = self.annotation_class(info.name, annotation) or self.expr_class(
                            info.name, value, params, cls
                        )
                        if found:
                            types.setdefault(target.attr, found)
        return types

    def _param_types(self, module: str, fn: ast.FunctionDef) -> dict[str, str]:
        types = {}
        for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            found = self.annotation_class(module, arg.annotation)
            if found:
                types[arg.arg] = found
        return types

    def expr_class(
        self, module: str, expr: ast.expr | None, local: dict[str, str], cls: ClassInfo | None
    ) -> str | None:
        """The dorarl class of the value `expr` makes, where it can be told statically."""
        if expr is None:
            return None
        if isinstance(expr, ast.Name):
            if expr.id == "self" and cls is not None:
                return f"{cls.module}.{cls.name}"
            return local.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.cls_of(self.expr_class(module, expr.value, local, cls))
            if owner is not None:
                found = self._field_type(owner, expr.attr)
                if found:
                    return found
            return None
        if isinstance(expr, ast.Call):
            target = self.resolve(module, expr.func, local, cls)
            if target is None:
                return None
            if target.node is None or target.node.name == "__init__":
                return target.cls
            if target.cls and target.node.name in ("start", "from_config") and target.bound:
                return target.cls  # classmethod constructors returning cls(...)
            owner = self.index[target.module]
            return self.annotation_class(owner.name, target.node.returns)
        if isinstance(expr, ast.IfExp):
            return self.expr_class(module, expr.body, local, cls) or self.expr_class(
                module, expr.orelse, local, cls
            )
        return None

    def _field_type(self, cls: ClassInfo, name: str) -> str | None:
        key = f"{cls.module}.{cls.name}"
        if not cls.attr_types and key not in self._typing:
            self._typing.add(key)  # read once, on first use (a class may name itself)
            cls.attr_types = self._attr_types(self.index[cls.module], cls) or {"": ""}
        if name in cls.attr_types:
            return cls.attr_types[name]
        prop = cls.methods.get(name)
        if prop is not None and any(ast.unparse(d) == "property" for d in prop.decorator_list):
            return self.annotation_class(cls.module, prop.returns)
        for parent in self.parents(cls):
            found = self._field_type(parent, name)
            if found:
                return found
        return None

    def resolve(
        self, module: str, func: ast.expr, local: dict[str, str], cls: ClassInfo | None
    ) -> Target | None:
        """What a call's `func` calls, when it is dorarl code."""
        if isinstance(func, ast.Name):
            if func.id == "cls" and cls is not None:
                return self._construct(cls)
            return self._named(self.lookup(module, func.id))
        if not isinstance(func, ast.Attribute):
            return None
        # a module or class reached by name: dorarl.x.f(), Cls.method()
        if isinstance(func.value, ast.Name) and func.value.id not in {*local, "self", "cls"}:
            base = self.lookup(module, func.value.id)
            if base is not None:
                if base in self.index:
                    return self._named(self._canonical(f"{base}.{func.attr}"))
                owner = self.cls_of(base)
                if owner is not None:
                    return self._method_target(owner, func.attr, bound=True)
        owner_name = self.expr_class(module, func.value, local, cls)
        if isinstance(func.value, ast.Name) and func.value.id == "cls" and cls is not None:
            owner_name = f"{cls.module}.{cls.name}"
        owner = self.cls_of(owner_name)
        if owner is None:
            return None
        return self._method_target(owner, func.attr, bound=True)

    def _named(self, qualified: str | None) -> Target | None:
        if qualified is None or qualified in self.index:
            return None
        module, _, name = qualified.rpartition(".")
        info = self.index[module]
        if name in info.functions:
            return Target(module, name, info.functions[name])
        if name in info.classes:
            return self._construct(info.classes[name])
        return None

    def _construct(self, cls: ClassInfo) -> Target:
        init = self.method(cls, "__init__") or self.method(cls, "__post_init__")
        qualified = f"{cls.module}.{cls.name}"
        if init is None:
            return Target(cls.module, cls.name, None, qualified)
        owner, node = init
        return Target(owner.module, f"{owner.name}.{node.name}", node, qualified, bound=True)

    def _method_target(self, cls: ClassInfo, name: str, bound: bool) -> Target | None:
        found = self.method(cls, name)
        if found is None:
            return None
        owner, node = found
        owner_name = f"{owner.module}.{owner.name}"
        return Target(owner.module, f"{owner.name}.{node.name}", node, owner_name, bound=bound)

    # ---- the walk ------------------------------------------------------------------------
    def enter(self, target: Target, params: Tracked) -> None:
        key = _key(target)
        if key in self.seen:
            return
        self.seen.add(key)
        self.trail.append((target.module, target.qualname))
        if target.node is None:
            return
        info = self.index[target.module]
        self._body(key, info, target.node, params, self.cls_of(target.cls))

    def _body(
        self,
        key: str,
        info: ModuleInfo,
        fn: ast.FunctionDef,
        params: Tracked,
        cls: ClassInfo | None,
    ) -> None:
        """Walk `fn` as it runs: each call entered in turn, each assignment tracking what
        it gives (so a value is tracked from where it is made on), what it returns kept."""
        local = self._param_types(info.name, fn)
        tracked: Tracked = dict(params)
        self_attrs: set[str] = set()  # self.x assigned from a tracked value
        nodes = [n for n in _in_order(fn) if hasattr(n, "lineno") and n is not fn]
        raised = {  # an error message that names a setting is no use of it
            id(n.exc) for n in nodes if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
        }
        for node in nodes:
            if isinstance(node, ast.Call) and id(node) not in raised:
                self._call(info, node, tracked, self_attrs, local, cls)
            if isinstance(node, ast.Return) and node.value is not None:
                carried = self._carried(info.name, node.value, tracked, self_attrs, local, cls)
                if not isinstance(carried, _Nothing):
                    _merge(self.returns, key, carried)
            targets, value, annotation = _assignment(node)
            if value is None:
                continue
            found = self.annotation_class(info.name, annotation) or self.expr_class(
                info.name, value, local, cls
            )
            carried = self._carried(info.name, value, tracked, self_attrs, local, cls)
            for target in targets:
                for name in _names(target):
                    if found and name not in local:
                        local[name] = found
                    if not isinstance(carried, _Nothing):
                        _merge(tracked, name, carried)
                if (
                    not isinstance(carried, _Nothing)
                    and isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    self_attrs.add(target.attr)

    def _carried(
        self,
        module: str,
        expr: ast.AST,
        tracked: Tracked,
        self_attrs: set[str],
        local: dict[str, str],
        cls: ClassInfo | None,
    ) -> Fields:
        """What of the tracked values `expr` gives: all of it (None), the tracked fields of a
        record built from some (their names), or NOTHING. A walked function's call gives
        what the function returned."""
        if isinstance(expr, ast.Name) and expr.id in tracked:
            return tracked[expr.id]
        if isinstance(expr, ast.Call):
            target = self.resolve(module, expr.func, local, cls)
            if target is not None and target.node is not None and _key(target) in self.seen:
                return self.returns.get(_key(target), NOTHING)
            fields = self._record_fields(module, expr, tracked, self_attrs, local, cls)
            if not isinstance(fields, _Nothing):
                return fields
        derived = self._derived(module, expr, tracked, self_attrs, local, cls)
        return None if derived else NOTHING

    def _record_fields(
        self,
        module: str,
        call: ast.Call,
        tracked: Tracked,
        self_attrs: set[str],
        local: dict[str, str],
        cls: ClassInfo | None,
    ) -> Fields:
        """The fields a dataclass constructor call fills from tracked values."""
        target = self.resolve(module, call.func, local, cls)
        made = self.cls_of(target.cls) if target and target.node is None else None
        if made is None or not self._is_data(target.cls if target else None):
            return NOTHING
        names = self._fields(made)
        filled = {k.arg: k.value for k in call.keywords if k.arg}
        filled.update(zip(names, call.args, strict=False))
        hits = frozenset(n for n, v in filled.items() if _reads(v, tracked, self_attrs))
        return hits if hits else NOTHING

    def _fields(self, cls: ClassInfo) -> list[str]:
        """A dataclass's fields in order (its dorarl bases' first)."""
        names: list[str] = []
        for base in cls.bases:
            parent = self.cls_of(self.lookup(cls.module, base.split("[")[0]))
            if parent is not None:
                names.extend(self._fields(parent))
        for item in cls.node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and "ClassVar" not in ast.unparse(item.annotation)
            ):
                names.append(item.target.id)
        return names

    def _derived(
        self,
        module: str,
        expr: ast.AST,
        tracked: Tracked,
        self_attrs: set[str],
        local: dict[str, str],
        cls: ClassInfo | None,
    ) -> bool:
        """Whether `expr` gives a piece of a tracked value: reads one, other than through a
        call of dorarl code that makes something with behaviour (a task, a runtime: what
        that code made, not the config's data) and is no method of a tracked value. A
        dataclass built from tracked values carries them on."""
        if isinstance(expr, ast.Call):
            target = self.resolve(module, expr.func, local, cls)
            receiver = expr.func.value if isinstance(expr.func, ast.Attribute) else None
            if (
                target is not None
                and not (receiver is not None and _reads(receiver, tracked, self_attrs))
                and not self._is_data(self.expr_class(module, expr, local, cls))
            ):
                return False
        if isinstance(expr, (ast.Name, ast.Attribute)):
            return _reads(expr, tracked, self_attrs)
        return any(
            self._derived(module, child, tracked, self_attrs, local, cls)
            for child in ast.iter_child_nodes(expr)
        )

    def _is_data(self, qualified: str | None) -> bool:
        """Whether the class `qualified` is a dataclass (a record of values)."""
        found = self.cls_of(qualified)
        return found is not None and any(
            "dataclass" in ast.unparse(d) for d in found.node.decorator_list
        )

    def _call(
        self,
        info: ModuleInfo,
        call: ast.Call,
        tracked: Tracked,
        self_attrs: set[str],
        local: dict[str, str],
        cls: ClassInfo | None,
    ) -> None:
        target = self.resolve(info.name, call.func, local, cls)
        if target is None:
            return
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        receiver_tracked = receiver is not None and _reads(receiver, tracked, self_attrs)
        positional = [_passed(a, tracked, self_attrs) for a in call.args]
        keywords = {k.arg: _passed(k.value, tracked, self_attrs) for k in call.keywords}
        passed = [p for p in [*positional, *keywords.values()] if p is not NOTHING]
        if not (receiver_tracked or passed):
            return
        params: Tracked = {}
        node = target.node
        if node is not None:
            names = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
            if target.bound and names[:1] in (["self"], ["cls"]):
                if receiver_tracked and names[0] == "self" and node.name != "__init__":
                    params["self"] = None
                names = names[1:]
            for name, given in zip(names, positional, strict=False):
                if given is not NOTHING:
                    _merge(params, name, given)
            if node.args.vararg and any(p is not NOTHING for p in positional[len(names) :]):
                params[node.args.vararg.arg] = None
            for key, given in keywords.items():
                if given is NOTHING:
                    continue
                if key is not None:
                    _merge(params, key, given)
                elif node.args.kwarg:
                    params[node.args.kwarg.arg] = None
        self.enter(target, params)


class _Nothing:
    """No tracked value."""


NOTHING = _Nothing()
Fields = frozenset[str] | None | _Nothing
"""What a value carries: all of a tracked value (None), some fields of one, or NOTHING."""
Tracked = dict[str, frozenset[str] | None]
"""The tracked names of a function: all tracked (None), or the tracked fields of a record."""


def _key(target: Target) -> str:
    return f"{target.module}.{target.qualname}"


def _merge(tracked: Tracked, name: str, fields: Fields) -> bool:
    """Add `fields` of `name` to `tracked`; whether that changed it."""
    assert not isinstance(fields, _Nothing)
    if name not in tracked:
        tracked[name] = fields
        return True
    old = tracked[name]
    new = None if old is None or fields is None else old | fields
    tracked[name] = new
    return new != old


def _passed(expr: ast.expr, tracked: Tracked, self_attrs: set[str]) -> Fields:
    """What an argument passes on: a tracked name as it is tracked, else all or NOTHING."""
    if isinstance(expr, ast.Name) and expr.id in tracked:
        return tracked[expr.id]
    return None if _reads(expr, tracked, self_attrs) else NOTHING


def _in_order(node: ast.AST) -> list[ast.AST]:
    """`node`'s nodes in the order Python evaluates them: statements in turn, a call after
    its function and arguments (a nested function or lambda where it is written)."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        found.extend(_in_order(child))
    found.append(node)
    return found


def _assignment(node: ast.AST) -> tuple[list[ast.expr], ast.expr | None, ast.expr | None]:
    if isinstance(node, ast.Assign):
        return list(node.targets), node.value, None
    if isinstance(node, ast.AnnAssign):
        return [node.target], node.value, node.annotation
    if isinstance(node, ast.NamedExpr):
        return [node.target], node.value, None
    if isinstance(node, (ast.For, ast.comprehension)):
        return [node.target], node.iter, None
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars], node.context_expr, None
    return [], None, None


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _names(elt)]
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return []


def _reads(expr: ast.AST, tracked: Tracked, self_attrs: set[str]) -> bool:
    """Whether `expr` reads a tracked value: a tracked name, a tracked field of a record,
    or a tracked `self` attribute."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        name = expr.value.id
        if name == "self" and expr.attr in self_attrs:
            return True
        if name in tracked:
            fields = tracked[name]
            return fields is None or expr.attr in fields
        return False
    if isinstance(expr, ast.Name):
        return expr.id in tracked
    return any(_reads(child, tracked, self_attrs) for child in ast.iter_child_nodes(expr))


def figures(trail: list[tuple[str, str]], index: dict[str, ModuleInfo]) -> dict[str, int]:
    """Climbs and returns along the files the walk entered."""
    files: list[str] = []
    for module, _ in trail:
        if not files or files[-1] != module:
            files.append(module)
    climbs = sum(1 for a, b in zip(files, files[1:], strict=False) if layer_of(b) > layer_of(a))
    returns = sum(1 for i, f in enumerate(files) if f in files[:i])
    return {
        "functions": len(trail),
        "files": len(set(files)),
        "steps": len(files) - 1,
        "climbs": climbs,
        "returns": returns,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", default="dorarl.jobs.ray_run:run_ray")
    parser.add_argument("--param", default="config")
    parser.add_argument("--trail", action="store_true", help="print every function entered")
    args = parser.parse_args(argv)
    index = _index()
    walk = Walk(index)
    module, _, name = args.start.partition(":")
    target = walk._named(f"{module}.{name}")
    if target is None:
        parser.error(f"--start: no function {args.start}")
    walk.enter(target, {args.param: None})
    if args.trail:
        for mod, qualname in walk.trail:
            print(f"  [{layer_of(mod)}] {mod}:{qualname}")
    result = figures(walk.trail, index)
    print(" ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
