"""Prepared data: the format and its checks (format, verified), opening and copying it (remote), the row store
(store) and the sample order (order). Every name is importable from `minilm.data` itself."""

from .format import (
    FORMAT,
    MANIFEST,
    TOKEN_DTYPES,
    TOKENIZER_FILE,
    DataError,
    PreparedData,
    cache_root,
    check_compatible,
    check_manifest,
    file_sha256,
    fit_configs,
    is_remote,
    token_dtype_for,
)
from .order import (
    VAL_SEED,
    DataPosition,
    RankOrder,
    check_val_samples,
    epoch_order,
    rank_micro_batches,
    split_ids,
    steps_per_epoch,
)
from .remote import COPY_CHUNK, _copy_verified, materialise, open_local, open_prepared
from .store import MAX_OPEN_SHARDS, LocalRankStream, RowsInMemory, SequenceStore
from .verified import record_verified, verify_hashes

__all__ = [
    "COPY_CHUNK", "FORMAT", "MANIFEST", "MAX_OPEN_SHARDS", "TOKENIZER_FILE", "TOKEN_DTYPES", "VAL_SEED",
    "DataError", "DataPosition", "LocalRankStream", "PreparedData", "RankOrder", "RowsInMemory", "SequenceStore",
    "_copy_verified", "cache_root", "check_compatible", "check_manifest", "check_val_samples", "epoch_order",
    "file_sha256", "fit_configs", "is_remote", "materialise", "open_local", "open_prepared", "rank_micro_batches",
    "record_verified", "split_ids", "steps_per_epoch", "token_dtype_for", "verify_hashes",
]
