"""Type stubs of the native module (python/src/lib.rs)."""

from typing import Any, Callable, Dict, List, Optional, Tuple

__version__: str

def placement(
    nodes: List[Tuple[str, float]], tenant: str, sequence_id: str, first_hash: Optional[bytes] = None
) -> List[int]: ...

def select_partitioned(parts: List[Tuple["Connection", str, int, int, int]], request: Any) -> List[Any]: ...

class Connection:
    def __init__(
        self,
        address: str,
        token: Optional[str] = None,
        ca_pem: Optional[bytes] = None,
        domain: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def call(
        self,
        method: str,
        request: Any,
        done: Optional[Callable[[Any, Optional[BaseException]], None]] = None,
        incarnation: Optional[int] = None,
        gather: bool = False,
    ) -> Any: ...
    def register_shm(self, socket: str, size: int, tenant: str) -> Region: ...

class Pending:
    def cancel(self) -> None: ...

class Region:
    @property
    def id(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def fd(self) -> int: ...
    @property
    def spin(self) -> float: ...
    @spin.setter
    def spin(self, seconds: float) -> None: ...
    @property
    def server_poll(self) -> float: ...
    @server_poll.setter
    def server_poll(self, seconds: float) -> None: ...
    def call(self, method: str, request: Any, gather: bool = False, views: bool = False) -> Any: ...

class SelectTotals:
    def to_dict(self) -> Dict[str, Any]: ...
    @property
    def store_us(self) -> int: ...
    @property
    def server_us(self) -> int: ...
    @property
    def attention(self) -> Optional[Tuple[bytes, bytes, bytes, bytes]]: ...
    def attention_out(self) -> bytearray: ...

class SelectRequest:
    def __init__(self, fields: Dict[str, Any]) -> None: ...
    def step(
        self,
        layer: int,
        queries: bytes,
        budget_pages: int,
        append: Optional[Tuple[int, int, bytes, bytes, Optional[int], bool]] = None,
    ) -> "SelectRequest": ...
