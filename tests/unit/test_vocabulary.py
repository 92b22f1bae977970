"""The vocabulary is defined once: no other module spells out the protocol, readout or magnification lists."""

import re
from typing import get_args

from cellpath.config import ExtractConfig, Params, ProbeConfig
from cellpath.runtime.code_deps import PACKAGE_DIR
from cellpath.vocabulary import MAGNIFICATION_MPP, MAGNIFICATIONS, PROTOCOLS, READOUTS

# A list of the vocabulary's names written out in code: three or more of them in a row.
SPELLED_OUT = {
    "protocols": re.compile(r"""["']iocd["'],\s*["']mocv["'],\s*["']looo["']"""),
    "readouts": re.compile(r"""["']N\+M["'],\s*["']N\+C["'],\s*["']N\|\|M["']"""),
    "magnifications": re.compile(r"""["']40x["'],\s*["']20x["'],\s*["']10x["']"""),
    "magnification µm/px": re.compile(r"""["']40x["']:\s*0\.25"""),
}


def test_no_module_but_the_vocabulary_spells_out_its_lists():
    found = [f"{path.relative_to(PACKAGE_DIR)}: {name}" for path in sorted(PACKAGE_DIR.rglob("*.py"))
             if path.name != "vocabulary.py" for name, pattern in SPELLED_OUT.items()
             if pattern.search(path.read_text())]
    assert not found, f"defined outside cellpath/vocabulary.py: {found}"


def test_the_config_takes_its_choices_and_defaults_from_the_vocabulary():
    (readout_type,) = get_args(ProbeConfig.model_fields["readouts"].annotation)  # list[ReadoutName]
    assert get_args(readout_type) == READOUTS and tuple(ProbeConfig().readouts) == READOUTS
    assert tuple(ExtractConfig().magnifications) == MAGNIFICATIONS == tuple(MAGNIFICATION_MPP)
    assert get_args(Params.model_fields["protocol"].annotation) == ("all", *PROTOCOLS)
