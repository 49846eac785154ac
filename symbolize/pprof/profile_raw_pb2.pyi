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

class CheckedLocations(_message.Message):
    __slots__ = ("location",)
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    location: _containers.RepeatedCompositeFieldContainer[_profile_pb2.Location]
    def __init__(self, location: _Optional[_Iterable[_Union[_profile_pb2.Location, _Mapping]]] = ...) -> None: ...

class MergedProfile(_message.Message):
    __slots__ = ("sample", "location", "function", "label_set")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    LABEL_SET_FIELD_NUMBER: _ClassVar[int]
    sample: MergedSample
    location: MergedLocation
    function: MergedFunction
    label_set: MergedLabelSet
    def __init__(self, sample: _Optional[_Union[MergedSample, _Mapping]] = ..., location: _Optional[_Union[MergedLocation, _Mapping]] = ..., function: _Optional[_Union[MergedFunction, _Mapping]] = ..., label_set: _Optional[_Union[MergedLabelSet, _Mapping]] = ...) -> None: ...

class MergedSample(_message.Message):
    __slots__ = ("location_id", "value", "label", "breakdown")
    LOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    location_id: _containers.RepeatedScalarFieldContainer[int]
    value: _containers.RepeatedScalarFieldContainer[int]
    label: MergedLabel
    breakdown: MergedBreakdown
    def __init__(self, location_id: _Optional[_Iterable[int]] = ..., value: _Optional[_Iterable[int]] = ..., label: _Optional[_Union[MergedLabel, _Mapping]] = ..., breakdown: _Optional[_Union[MergedBreakdown, _Mapping]] = ...) -> None: ...

class MergedLabel(_message.Message):
    __slots__ = ("key", "str", "num", "num_unit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STR_FIELD_NUMBER: _ClassVar[int]
    NUM_FIELD_NUMBER: _ClassVar[int]
    NUM_UNIT_FIELD_NUMBER: _ClassVar[int]
    key: _containers.RepeatedScalarFieldContainer[int]
    str: _containers.RepeatedScalarFieldContainer[int]
    num: _containers.RepeatedScalarFieldContainer[int]
    num_unit: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[_Iterable[int]] = ..., str: _Optional[_Iterable[int]] = ..., num: _Optional[_Iterable[int]] = ..., num_unit: _Optional[_Iterable[int]] = ...) -> None: ...

class MergedLabelSet(_message.Message):
    __slots__ = ("id", "label")
    ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    id: _containers.RepeatedScalarFieldContainer[int]
    label: MergedLabel
    def __init__(self, id: _Optional[_Iterable[int]] = ..., label: _Optional[_Union[MergedLabel, _Mapping]] = ...) -> None: ...

class MergedBreakdown(_message.Message):
    __slots__ = ("ticks", "value", "label_set_id")
    TICKS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LABEL_SET_ID_FIELD_NUMBER: _ClassVar[int]
    ticks: _containers.RepeatedScalarFieldContainer[int]
    value: _containers.RepeatedScalarFieldContainer[int]
    label_set_id: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ticks: _Optional[_Iterable[int]] = ..., value: _Optional[_Iterable[int]] = ..., label_set_id: _Optional[_Iterable[int]] = ...) -> None: ...

class MergedLocation(_message.Message):
    __slots__ = ("id", "mapping_id", "address", "line", "is_folded")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAPPING_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    IS_FOLDED_FIELD_NUMBER: _ClassVar[int]
    id: _containers.RepeatedScalarFieldContainer[int]
    mapping_id: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    line: MergedLine
    is_folded: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, id: _Optional[_Iterable[int]] = ..., mapping_id: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ..., line: _Optional[_Union[MergedLine, _Mapping]] = ..., is_folded: _Optional[_Iterable[bool]] = ...) -> None: ...

class MergedLine(_message.Message):
    __slots__ = ("function_id", "line", "column")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    function_id: _containers.RepeatedScalarFieldContainer[int]
    line: _containers.RepeatedScalarFieldContainer[int]
    column: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, function_id: _Optional[_Iterable[int]] = ..., line: _Optional[_Iterable[int]] = ..., column: _Optional[_Iterable[int]] = ...) -> None: ...

class MergedFunction(_message.Message):
    __slots__ = ("id", "name", "system_name", "filename", "start_line")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_NAME_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    START_LINE_FIELD_NUMBER: _ClassVar[int]
    id: _containers.RepeatedScalarFieldContainer[int]
    name: _containers.RepeatedScalarFieldContainer[int]
    system_name: _containers.RepeatedScalarFieldContainer[int]
    filename: _containers.RepeatedScalarFieldContainer[int]
    start_line: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[_Iterable[int]] = ..., name: _Optional[_Iterable[int]] = ..., system_name: _Optional[_Iterable[int]] = ..., filename: _Optional[_Iterable[int]] = ..., start_line: _Optional[_Iterable[int]] = ...) -> None: ...

class MergedRunsProfile(_message.Message):
    __slots__ = ("sample", "location", "function", "label_set")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    LABEL_SET_FIELD_NUMBER: _ClassVar[int]
    sample: MergedRunsSample
    location: MergedLocation
    function: MergedFunction
    label_set: MergedLabelSet
    def __init__(self, sample: _Optional[_Union[MergedRunsSample, _Mapping]] = ..., location: _Optional[_Union[MergedLocation, _Mapping]] = ..., function: _Optional[_Union[MergedFunction, _Mapping]] = ..., label_set: _Optional[_Union[MergedLabelSet, _Mapping]] = ...) -> None: ...

class MergedRunsSample(_message.Message):
    __slots__ = ("location_id", "value", "label", "breakdown")
    LOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    location_id: _containers.RepeatedScalarFieldContainer[bytes]
    value: _containers.RepeatedScalarFieldContainer[int]
    label: MergedLabel
    breakdown: MergedBreakdown
    def __init__(self, location_id: _Optional[_Iterable[bytes]] = ..., value: _Optional[_Iterable[int]] = ..., label: _Optional[_Union[MergedLabel, _Mapping]] = ..., breakdown: _Optional[_Union[MergedBreakdown, _Mapping]] = ...) -> None: ...
