"""`DecodeMeta.pack`: decode rows into the step's metadata columns (`DecodeColumns`) and block tables."""

from __future__ import annotations

import numpy as np
import torch

from q3tts.engine.cuda_graph import DecodeMeta, DecodeRow


def test_pack_writes_each_rows_columns_and_pages_then_padding_rows():
    pack = DecodeMeta(page_size=4, max_pages=6, dummy_slot=9, dummy_page=99)
    rows = [DecodeRow(slot=3, position=5, frame=2, pages=[7, 1]),  # position 5: page 1 (id 1), offset 1
            DecodeRow(slot=0, position=0, frame=0, pages=[4]),
            DecodeRow(slot=8, position=22, frame=17, pages=[10, 11, 12, 13, 14, 15])]
    meta, tables = np.full((5, DecodeMeta.NUM_COLUMNS), -7, np.int64), np.full((5, 6), -7, np.int32)
    pack.pack(rows, meta, tables)
    cols = DecodeMeta.columns(torch.from_numpy(meta))
    assert cols.slot.tolist() == [3, 0, 8, 9, 9]
    assert cols.position.tolist() == [5, 0, 22, 0, 0]
    assert cols.slot_mapping.tolist() == [1 * 4 + 1, 4 * 4, 15 * 4 + 2, -1, -1]
    assert cols.context_len.tolist() == [6, 1, 23, 1, 1]
    assert cols.frame.tolist() == [2, 0, 17, 0, 0]
    assert tables.tolist() == [[7, 1] + [99] * 4, [4] + [99] * 5, [10, 11, 12, 13, 14, 15], [99] * 6, [99] * 6]
