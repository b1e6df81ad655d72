"""The public API's optional sampling fields (proto3 `optional` scalars of
text.proto's SamplingParams): the tier copies the ones a request sets, the client sets the
ones its flags give, both from this one list so a new field reaches both. Unset means
"the server's default"."""

from protos.llmserve.v1 import text_pb2

OPTIONAL_SAMPLING_FIELDS = tuple(
    field.name
    for field in text_pb2.SamplingParams.DESCRIPTOR.fields
    if field.has_presence and field.message_type is None
)
