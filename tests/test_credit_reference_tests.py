"""NCAR CREDIT's own ``tests/test_domain_parallel.py``, run against credit_mpi through an import alias.

The file is CREDIT's, copied verbatim into ``tests/third_party/credit_test_domain_parallel.py`` (with its
license header: CI has no network to fetch it); ``CREDIT_TESTS=/path/to/test_domain_parallel.py``
runs another copy instead (e.g. one read from a fetched miles-credit checkout). It is loaded
inside :func:`credit_mpi.nn.compat.credit_alias` (``credit.domain_parallel.*`` resolve to
credit_mpi's names), without the tests of CREDIT's private helpers: the classes that call a
``_`` name imported from CREDIT (``TestNeedsHalo``, ``TestNeedsHaloConvTranspose3d``: CREDIT's
``_needs_halo_*`` decide which layers its converter replaces; credit_mpi replaces every layer of
those types and computes each band's halo), listed in :data:`PRIVATE_TESTS`.

The MPI tests below run CREDIT's spelling on real ranks: layers built by wrapping a module,
one-argument custom converters, ``DomainParallelCrossEmbedBranch``, exact against one process.
"""

from __future__ import annotations

import ast
import copy
import os
import types
from pathlib import Path

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

from credit_mpi.nn import compat  # noqa: E402

from .nn_reference import bands_of  # noqa: E402

SOURCE = Path(os.environ.get("CREDIT_TESTS") or Path(__file__).parent / "third_party" / "credit_test_domain_parallel.py")


def _load(path: Path) -> tuple[types.ModuleType, list[str]]:
    """CREDIT's test module without its private-helper tests (and their imports): the module and their names."""
    tree = ast.parse(path.read_text(), str(path))
    private = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("credit."):
            private |= {a.asname or a.name for a in node.names if a.name.startswith("_")}
            node.names = [a for a in node.names if not a.name.startswith("_")]
    dropped = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
               and any(isinstance(x, ast.Name) and x.id in private for x in ast.walk(n))]
    tree.body = [n for n in tree.body if not (isinstance(n, ast.ClassDef) and n.name in dropped)]
    module = types.ModuleType("credit_reference_test_domain_parallel")
    module.__file__ = str(path)
    with compat.credit_alias():
        exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 - CREDIT's test file
    return module, dropped


_REFERENCE, PRIVATE_TESTS = _load(SOURCE)
globals().update({name: obj for name, obj in vars(_REFERENCE).items() if name.startswith("Test") and isinstance(obj, type)})


@pytest.fixture(autouse=True)
def credit_alias():
    """CREDIT's tests import ``credit.domain_parallel`` inside test bodies too."""
    with compat.credit_alias() as package:
        yield package


def test_the_private_helper_tests_are_the_only_ones_left_out():
    assert PRIVATE_TESTS == ["TestNeedsHalo", "TestNeedsHaloConvTranspose3d"], PRIVATE_TESTS
    kept = [n for n in vars(_REFERENCE) if n.startswith("Test")]
    assert len(kept) == 6, kept


def test_credit_names_resolve_to_credit_mpi(credit_alias):
    import credit.domain_parallel as dp
    from credit.domain_parallel.layers import DomainParallelConv2d

    import credit_mpi
    from credit_mpi import nn as cnn

    assert dp.shard_tensor is credit_mpi.shard_tensor and dp.HaloExchange is cnn.HaloExchange
    assert dp.validate_sharding_constraints is cnn.validate_sharding_constraints
    conv = torch.nn.Conv2d(2, 2, 3, padding=1)
    layer = DomainParallelConv2d(conv)
    assert isinstance(layer, cnn.DomainParallelConv2d) and layer.weight is conv.weight and layer.halo_width == 1
    converted = cnn.convert_to_domain_parallel(torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3)), None)
    assert isinstance(converted[0], DomainParallelConv2d)  # the converter's layers are CREDIT's kind too
    with pytest.raises(TypeError, match="wraps an Conv2d, got Linear"):
        DomainParallelConv2d(torch.nn.Linear(2, 2))


class PeriodicConv2d(torch.nn.Module):
    """CREDIT's PeriodicConv2d (credit.models.unet_diffusion): circular longitude, reflected latitude, no conv padding."""

    def __init__(self, dim_in, dim_out, kernel_size=3, padding=1):
        super().__init__()
        self.padding = padding
        self.conv = torch.nn.Conv2d(dim_in, dim_out, kernel_size, padding=0)

    def forward(self, x):
        x = torch.nn.functional.pad(x, (self.padding, self.padding, 0, 0), mode="circular")
        x = torch.nn.functional.pad(x, (0, 0, self.padding, self.padding), mode="reflect")
        return self.conv(x)


def _branch_model():
    from .credit_stand_ins import credit_models

    CrossEmbedLayer = credit_models()[1].CrossEmbedLayer  # noqa: N806
    return torch.nn.Sequential(CrossEmbedLayer(2, 4, (2, 4), stride=2), torch.nn.GELU(), PeriodicConv2d(4, 3))


def _same_on_bands(build, shape, manager, convert):
    """Forward and input gradient of ``convert(copy)`` on bands equal one process's ``build()`` (float64)."""
    torch.manual_seed(0)
    ref = build().double()
    model = convert(copy.deepcopy(ref))
    x = torch.randn(shape, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    weight = torch.randn(out_ref.shape, dtype=torch.float64)
    (out_ref * weight).sum().backward()
    start, stop = bands_of(shape[-2], manager)
    xl = x[..., start:stop, :].clone().requires_grad_()
    out = model(xl)
    comm = manager.domain_group
    o0 = comm.exscan(out.shape[-2]) or 0
    (out * weight[..., o0 : o0 + out.shape[-2], :]).sum().backward()
    full = torch.cat([torch.from_numpy(a) for a in comm.allgather(out.detach().numpy())], dim=-2)
    torch.testing.assert_close(full, out_ref.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(xl.grad, xr.grad[..., start:stop, :], atol=1e-12, rtol=1e-10)


# heights whose CrossEmbedLayer branches (kernels 2 and 4, stride 2) give bands that join (describe() says so), and
# whose outer bands keep two rows for the reflected latitude (input bands even and uneven)
HEIGHTS = {2: (10, 13), 3: (19, 25), 4: (25, 33)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which", [0, 1])
def test_credit_style_converters_are_exact_on_bands(which, make_manager):
    """CREDIT's one-argument converters and wrapped layers, on 2..4 ranks, even (2 ranks) and uneven bands."""
    size = MPI.COMM_WORLD.Get_size()
    if size not in HEIGHTS:
        pytest.skip("heights chosen for 2-4 ranks")
    height = HEIGHTS[size][which]
    manager = make_manager(size)
    pytest.importorskip("einops")
    pytest.importorskip("credit")
    from .credit_stand_ins import credit_models

    CrossEmbedConvBranch = credit_models()[1].CrossEmbedConvBranch  # noqa: N806

    with compat.credit_alias():
        from credit.domain_parallel import (
            DomainParallelCrossEmbedBranch,
            DomainParallelPeriodicConv2d,
            convert_to_domain_parallel,
        )

    def credit_convert(model):  # as a CREDIT trainer writes it
        return convert_to_domain_parallel(model, manager, custom_converters={
            PeriodicConv2d: lambda m: DomainParallelPeriodicConv2d(m),
            CrossEmbedConvBranch: DomainParallelCrossEmbedBranch,
        })

    def plain_convert(model):  # credit_mpi needs no custom converter for either
        return compat.convert_to_domain_parallel(model, manager, custom_converters={PeriodicConv2d: compat.DomainParallelPeriodicConv2d})

    _same_on_bands(_branch_model, (1, 2, height, 8), manager, credit_convert)
    _same_on_bands(_branch_model, (1, 2, height, 8), manager, plain_convert)
