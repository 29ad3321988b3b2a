"""dstrain/fields.py's field docs: the string literal under each field, whitespace collapsed, found the same way
for a class at a module's top level, one nested in a class (both from one parse of the module) and one defined
inside a function (from its own source); a subclass's docs override its base's, `metadata["help"]` overrides
both."""

from __future__ import annotations

import dataclasses

from dstrain.fields import field_docs


@dataclasses.dataclass
class Base:
    lr: float = 1e-3
    """The peak
    learning rate."""
    steps: int = 10
    """How many steps."""
    undocumented: int = 0

    @dataclasses.dataclass
    class Inner:
        depth: int = 1
        """Nested: its own docs."""


@dataclasses.dataclass
class Child(Base):
    steps: int = 20
    """Steps, as the child documents them."""
    seed: int = dataclasses.field(default=0, metadata={"help": "from metadata"})
    """Overridden by the metadata."""


def test_docs_of_top_level_nested_and_inherited_fields():
    assert field_docs(Base) == {"lr": "The peak learning rate.", "steps": "How many steps."}
    assert field_docs(Base.Inner) == {"depth": "Nested: its own docs."}
    assert field_docs(Child) == {
        "lr": "The peak learning rate.",
        "steps": "Steps, as the child documents them.",
        "seed": "from metadata",
    }


def test_docs_of_a_class_defined_in_a_function():
    @dataclasses.dataclass
    class Local:
        lr: float = 1e-3
        """A local class's doc."""

    assert field_docs(Local) == {"lr": "A local class's doc."}
