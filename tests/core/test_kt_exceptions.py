"""The EXL3 linear's k-chunk exception table (exl3_core.ext): rows are checked in Python, before any
reaches the extension (where an error would take the process down on some images)."""
from __future__ import annotations

import pytest

from exl3_core import ext


@pytest.mark.parametrize("bad", [(132, 4, 256), (132, 4, 256, 224, 0), (132, 4, 256, 224, 33),
                                 (132, 4.0, 256, 224, 24), (132, 4, -256, 224, 24)])
def test_bad_rows_are_refused(bad: tuple) -> None:
    with pytest.raises(ValueError, match="k-chunk exception"):
        ext.set_kt_exceptions([bad])


def test_shipped_table_is_valid() -> None:
    ext.load()
    installed = ext.set_kt_exceptions(ext.KT_EXCEPTIONS)
    assert installed in (0, len(ext.KT_EXCEPTIONS))  # 0: an extension without the CUDA linear
    assert all(len(r) == 5 and r[4] <= 32 for r in ext.KT_EXCEPTIONS)
