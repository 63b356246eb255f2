"""dflash_offline: offline, two-stage training of DFlash speculative-decoding drafters for Qwen targets."""

import importlib.abc as _abc
import logging as _logging
import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"


class _ImportNotes(_logging.Filter):
    """Drops two notes printed whenever transformers imports torchao (installed for precision=fp8) while loading any
    model: the compiled extensions this machine cannot load (CUDA-only or other-architecture kernels; float8
    training does not use them) and torch's deprecation of torchao's pytree registrations. Anything else passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load ") and "torchao" in msg) and \
            "natively supported by torch.compile as an opaque value type" not in msg


for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).addFilter(_ImportNotes())
# and Python 3.12's SyntaxWarning for the invalid escapes in torchao's docstrings, printed when a first import compiles
# them (where the install did not write their bytecode)
_warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*[/\\]torchao[/\\]")


# transformers' modeling modules whose kernel choice `target.route_gated_deltanet_by_device` corrects
_ROUTED = ("transformers.models.qwen3_5.modeling_qwen3_5",)


def _route(module) -> None:
    from dflash_offline.target import route_gated_deltanet_by_device

    route_gated_deltanet_by_device(module)


class _RoutingLoader(_abc.Loader):
    """The loader a module of `_ROUTED` was found with, its functions routed once the module has run (other modules
    that loader serves are left as they are: a zip importer serves a whole archive)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _route(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, …: the loader's own
        return getattr(self._loader, name)


class _RouteOnImport(_abc.MetaPathFinder):
    """Whenever transformers imports a module of `_ROUTED` in a process that imported dflash_offline (every stage,
    test and benchmark; also a Qwen3.5 model loaded directly through transformers there), its Gated DeltaNet functions
    are routed by device right after the module runs: CPU tensors take the torch path even where fla imports (Triton
    installed, no GPU). The module is found by the finders after this one, as it would have been; this one imports
    nothing itself."""

    def find_spec(self, name, path, target=None):
        if name not in _ROUTED:
            return None
        for finder in _sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _RouteOnImport) or find is None:  # (itself among them)
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RoutingLoader(spec.loader)
                return spec
        return None


# one hook per process, also after importlib.reload(dflash_offline) (whose classes are new ones)
if not any(type(f).__name__ == "_RouteOnImport" and type(f).__module__ == __name__ for f in _sys.meta_path):
    _sys.meta_path.insert(0, _RouteOnImport())
for _name in _ROUTED:
    if _name in _sys.modules:  # imported before dflash_offline
        _route(_sys.modules[_name])
