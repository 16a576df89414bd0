"""ppdsl/runtime/_lazy.py: a face's names are imported from their submodule on
first use, a submodule's own name is the module, and an unknown name is an
AttributeError naming the package."""

from __future__ import annotations

import pytest

from ppdsl.runtime._lazy import lazy_getattr


def test_names_come_from_their_submodules():
    """A name is looked up in its submodule; a name equal to the submodule's is it."""
    get = lazy_getattr("ppdsl.runtime", {"split_layers": "models.model", "model": "models.model"})
    from ppdsl.runtime.models import model

    assert get("split_layers") is model.split_layers
    assert get("model") is model


def test_unknown_name_is_an_attribute_error():
    """A name the table lacks raises AttributeError (what `hasattr` and `from X
    import y` expect), naming the package."""
    get = lazy_getattr("ppdsl.runtime", {})
    with pytest.raises(AttributeError, match="'ppdsl.runtime' has no attribute 'nothing'"):
        get("nothing")
