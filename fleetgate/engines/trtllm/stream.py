"""How trtllm-serve writes a plain streamed token event (:class:`TokenEventShapes`).

Chat chunks are serialised without their ``None`` fields (``exclude_none``), so a
plain one is just ``{"index":0,"delta":{"content":"..."}}``; completions chunks
carry every field, ``token_ids`` always ``null`` (fleetgate never asks
trtllm-serve for them) and a ``"usage":null`` after the choices. An event with
more fields (an empty ``reasoning_content``, say) is not matched and is read as
JSON: same output, slower.
"""

from __future__ import annotations

import re

from fleetgate.engines._common import SSE_JSON_STRING
from fleetgate.engines.base import TokenEventShapes

TOKEN_EVENTS = TokenEventShapes(
    chat=(
        re.compile(
            rb'\{"index":0,"delta":\{"content":"(?P<text>' + SSE_JSON_STRING + rb')"\}\}\]\}\n\n'
        ),
    ),
    completions=(
        re.compile(
            rb'\{"index":0,"text":"(?P<text>' + SSE_JSON_STRING + rb')","token_ids":(?P<ids>null),'
            rb'"logprobs":null,"finish_reason":null,"stop_reason":null\}\],"usage":null\}\n\n'
        ),
    ),
)
