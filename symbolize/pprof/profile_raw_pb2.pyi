from symbolize.pprof import profile_pb2 as _profile_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RawProfile(_message.Message):
    __slots__ = ("sample_type", "sample", "mapping", "location", "function", "string_table", "drop_frames", "keep_frames", "time_nanos", "duration_nanos", "period_type", "period", "comment", "default_sample_type", "tick_unit", "label_set")
    SAMPLE_TYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    STRING_TABLE_FIELD_NUMBER: _ClassVar[int]
    DROP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    KEEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TIME_NANOS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NANOS_FIELD_NUMBER: _ClassVar[int]
    PERIOD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TICK_UNIT_FIELD_NUMBER: _ClassVar[int]
    LABEL_SET_FIELD_NUMBER: _ClassVar[int]
    sample_type: _containers.RepeatedCompositeFieldContainer[_profile_pb2.ValueType]
    sample: _containers.RepeatedScalarFieldContainer[bytes]
    mapping: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Mapping]
    location: _containers.RepeatedScalarFieldContainer[bytes]
    function: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Function]
    string_table: _containers.RepeatedScalarFieldContainer[str]
    drop_frames: int
    keep_frames: int
    time_nanos: int
    duration_nanos: int
    period_type: _profile_pb2.ValueType
    period: int
    comment: _containers.RepeatedScalarFieldContainer[int]
    default_sample_type: int
    tick_unit: int
    label_set: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, sample_type: _Optional[_Iterable[_Union[_profile_pb2.ValueType, _Mapping]]] = ..., sample: _Optional[_Iterable[bytes]] = ..., mapping: _Optional[_Iterable[_Union[_profile_pb2.Mapping, _Mapping]]] = ..., location: _Optional[_Iterable[bytes]] = ..., function: _Optional[_Iterable[_Union[_profile_pb2.Function, _Mapping]]] = ..., string_table: _Optional[_Iterable[str]] = ..., drop_frames: _Optional[int] = ..., keep_frames: _Optional[int] = ..., time_nanos: _Optional[int] = ..., duration_nanos: _Optional[int] = ..., period_type: _Optional[_Union[_profile_pb2.ValueType, _Mapping]] = ..., period: _Optional[int] = ..., comment: _Optional[_Iterable[int]] = ..., default_sample_type: _Optional[int] = ..., tick_unit: _Optional[int] = ..., label_set: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RawLocations(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, location: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CheckedAsBytes(_message.Message):
    __slots__ = ("sample", "location", "label_set")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    LABEL_SET_FIELD_NUMBER: _ClassVar[int]
    sample: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Sample]
    location: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Location]
    label_set: _containers.RepeatedCompositeFieldContainer[_profile_pb2.LabelSet]
    def __init__(self, sample: _Optional[_Iterable[_Union[_profile_pb2.Sample, _Mapping]]] = ..., location: _Optional[_Iterable[_Union[_profile_pb2.Location, _Mapping]]] = ..., label_set: _Optional[_Iterable[_Union[_profile_pb2.LabelSet, _Mapping]]] = ...) -> None: ...
