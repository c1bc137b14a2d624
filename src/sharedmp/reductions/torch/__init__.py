"""PyTorch on the wire, one module per job; imported only once torch is.

    codes.py     what a tensor is made of beside its bytes: dtype codes, flags, sparse parts
    storage.py   where a CPU storage's bytes live; moving them into sharedmp memory in place;
                 the identity table (one storage per memory region per process)
    sharing.py   the public side: share_memory_, is_shared, empty, empty_like; optimizer state
    tensors.py   reduce/rebuild pairs of storages and tensors, the tensor frame kind
    patch.py     torch's UntypedStorage.share_memory_/is_shared/_new_shared made aware of
                 sharedmp memory: install() / uninstall()

The registry (``sharedmp/registry.py``) installs ``tensors.reducers()``, ``tensors.FRAME``
and ``patch`` once ``tensors`` is imported, which imports torch.

Private torch API used here (tests/test_torch.py checks that this list is complete):
``UntypedStorage._swap_data_ptr_`` (probed: ``storage.HAVE_SWAP``),
``torch._C._construct_storage_from_data_pointer`` (probed: ``KEEP_BY_ATTRIBUTE``),
``torch._C.StorageBase.is_shared``, ``UntypedStorage._share_fd_cpu_``,
``_share_filename_cpu_``, ``_get_shared_fd``, ``_new_shared_fd_cpu``,
``_new_shared_filename_cpu``, ``_shared_incref``, ``_shared_decref``, ``_new_shared``
(probed: ``patch.probe``), ``TypedStorage._untyped_storage`` and its ``_internal=True``
constructor, ``torch._storage_classes``, ``torch._tensor_classes``, ``torch._C._set_conj``,
``torch._C._set_neg``, ``Tensor._backward_hooks``, ``_indices``, ``_values``,
``_nested_tensor_size``, ``_nested_tensor_strides``, ``_nested_tensor_storage_offsets``,
``torch._nested_view_from_buffer_copy``, ``torch.optim.optimizer._get_scalar_dtype``
(looked up, with a fallback), and torch.multiprocessing.reductions' ``reduce_tensor`` /
``reduce_storage`` for the devices sharedmp leaves to torch.
"""
# torch first, before any module of this package runs: its import installs the reducers
# (registry.py), which import tensors.py and the modules it needs, all whole.
import torch  # noqa: F401,E402
