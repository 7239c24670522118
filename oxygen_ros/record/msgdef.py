"""ROS 2 message definitions in the form MCAP's `ros2msg` schema encoding wants (rosbag2's concatenated
format: the type's fields, then every nested type once under a `MSG: pkg/Name` line), built from the
generated Python types' introspection data (SLOT_TYPES). It works for any installed type, service events
and action messages included, without the .msg files (a pip install of the ROS wheels has no
AMENT_PREFIX_PATH to find them by)."""
from __future__ import annotations

import importlib
from functools import lru_cache

from rosidl_parser import definition as idl

SEPARATOR = "=" * 80
BASIC = {"boolean": "bool", "octet": "byte", "float": "float32", "double": "float64", "char": "char",
         "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16", "int32": "int32",
         "uint32": "uint32", "int64": "int64", "uint64": "uint64"}


def type_name(msg_type) -> str:
    """'sensor_msgs/msg/CompressedImage', as rosbag2 names schemas and `ros2 bag info` shows them."""
    module = msg_type.__module__.split(".")
    return f"{module[0]}/{module[1]}/{msg_type.__name__}"


def resolve(name: str):
    """'pkg/ns/Name' (or 'pkg/Name' for a msg) -> the generated Python class. It imports the package the
    name says: only for names of installed types this package chose (the nested types of a definition),
    never for a name read from a file (replay maps its topics to fixed types instead)."""
    parts = name.split("/")
    package, namespace, cls = (parts[0], "msg", parts[1]) if len(parts) == 2 else parts
    module = importlib.import_module(f"{package}.{namespace}")
    if hasattr(module, cls):
        return getattr(module, cls)
    for attr in dir(module):          # action/service parts live in the private module (_converse...)
        sub = getattr(module, attr)
        if attr.startswith("_") and hasattr(sub, cls) and isinstance(getattr(sub, cls), type):
            return getattr(sub, cls)
    raise ImportError(f"no ROS type {name}")


def _nested_name(t: idl.NamespacedType) -> str:
    return f"{t.namespaces[0]}/{t.name}"


def _field_type(t, nested: list[idl.NamespacedType]) -> str:
    if isinstance(t, idl.AbstractNestedType):
        inner = _field_type(t.value_type, nested)
        if isinstance(t, idl.Array):
            return f"{inner}[{t.size}]"
        if isinstance(t, idl.BoundedSequence):
            return f"{inner}[<={t.maximum_size}]"
        return f"{inner}[]"
    if isinstance(t, idl.BasicType):
        return BASIC[t.typename]
    if isinstance(t, idl.BoundedString):
        return f"string<={t.maximum_size}"
    if isinstance(t, idl.AbstractString):
        return "string"
    if isinstance(t, idl.AbstractWString):
        return "wstring"
    if isinstance(t, idl.NamespacedType):
        nested.append(t)
        return _nested_name(t)
    raise TypeError(f"unsupported field type {t!r}")


def _fields(msg_type, nested: list) -> str:
    names = list(msg_type.get_fields_and_field_types())
    return "\n".join(f"{_field_type(t, nested)} {n}" for t, n in zip(msg_type.SLOT_TYPES, names)) + "\n"


@lru_cache(maxsize=None)
def message_definition(msg_type) -> str:
    nested: list[idl.NamespacedType] = []
    parts = [_fields(msg_type, nested)]
    seen: set[str] = set()
    while nested:
        t = nested.pop(0)
        name = _nested_name(t)
        if name in seen:
            continue
        seen.add(name)
        cls = resolve("/".join(t.namespaces + [t.name]))
        parts.append(f"{SEPARATOR}\nMSG: {name}\n{_fields(cls, nested)}")
    return "".join(parts)
