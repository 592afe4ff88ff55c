"""shardings.comm.peak_memory: the most bytes live tensors held at once (entry, new storages, frees, resizes)."""

import torch
from torch.testing._internal.two_tensor import TwoTensor

from shardings.comm.peak_memory import peak_memory


def test_counts_new_storages_once_and_their_frees():
    held = torch.zeros(1000)  # 4000 B live at entry
    with peak_memory() as m:
        a = torch.ones(250)  # +1000
        b = a * 2  # +1000
        view = b[:10]  # a view: the same storage, counted once
        del a  # -1000
        c = torch.ones(500)  # +2000: 7000 live
        del c  # -2000
    assert m.at_entry >= held.nbytes and (m.live - m.at_entry, m.peak - m.at_entry) == (1000, 3000)
    assert view.untyped_storage().nbytes() == 1000


def test_storage_resizes_count_like_allocations():
    """FSDP2 frees and re-allocates gathered parameters by resizing their storage."""
    unsharded = torch.empty(1000)
    with peak_memory() as m:
        unsharded.untyped_storage().resize_(0)  # -4000
        low = m.live
        unsharded.untyped_storage().resize_(4000)  # +4000
        fresh = torch.empty(10)
        fresh.untyped_storage().resize_(400)  # seen at its new size
    assert m.at_entry - low == 4000 and m.live - m.at_entry == 400 and m.peak == m.live


def test_backward_temporaries_count_and_subclasses_count_their_inner_tensors():
    x = torch.randn(64, 64, requires_grad=True)
    with peak_memory() as m:
        y = (x.exp() * 3).sum()
        after_forward = m.peak
        y.backward()  # grad of exp's input and x.grad: new storages during backward
    assert m.peak - after_forward >= x.nbytes
    pair = TwoTensor(torch.ones(16), torch.ones(16))  # a wrapper subclass, as DTensor and LocalTensor are
    with peak_memory() as m:
        before = m.live
        doubled = pair * 2
    assert m.live - before == 2 * 64 and isinstance(doubled, TwoTensor)  # both inner blocks
