"""The protocol between actors and learner, in three parts:

    wire.py       the codec every message uses: a msgpack header frame and the arrays' raw bytes,
                  checked against hostile input (no pickle, allow-listed dtypes, bounded sizes)
    segments.py   trajectory segments: the schema (the head's replay fields included) and the
                  checks a learner rank makes on receipt
    messages.py   weights and the control messages

No sockets here: common/transport/__init__.py moves the frames. Importers take names from this package.
"""

from .messages import (CONTROL_META, CONTROL_META_OPTIONAL, FREE_META, bf16_bits_to_float32, control_of,
                       decode_control, decode_weights, encode_control, encode_weights, files_of, weights_of)
from .segments import (FINAL_FIELDS, MAX_ABS_LOGP, MAX_ABS_STATE, MAX_ABS_UNIT, MAX_EPISODE_STEPS,
                       MAX_SEGMENT_SECONDS, OBS_FIELDS, SEGMENT_FIELDS, SEGMENT_META, SEGMENT_META_OPTIONAL,
                       STATE_FIELDS, UNTIMED_FIELDS, Field, Segment, SegmentSpec, check_groups,
                       check_segment_arrays, check_segment_meta, decode_segment, encode_segment, final_field,
                       time_major, wire_order)
from .wire import (ALIGN, DTYPES, INT64_MAX, MAX_DEPTH, MAX_ELEMENTS, MAX_NAME_LEN, MAX_NDIM, PACK_BELOW,
                   REQUEST_MAX_BYTES, SCHEMA_VERSION, SEGMENT, WEIGHTS, Layout, Limits, Message, ValidationError,
                   all_finite, check_meta, decode, encode, expect_kind, total, total_bytes)
