"""The gateway's conversation record (protocol.md §3.1 conversation.item.*, §7.3).

History text only: audio bytes are never kept. The model's own context (its KV) is not affected by
anything here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class HistoryItem:
    id: str
    role: str  # "user" | "assistant"
    status: str
    text: str = ""  # assistant: committed transcript / text
    text_only: bool = False
    audio_ms: int = 0  # user: item audio duration

    def to_json(self) -> dict[str, Any]:
        if self.role == "user":
            content = [{"type": "input_audio", "transcript": None}]
        elif self.text_only:
            content = [{"type": "output_text", "text": self.text}]
        else:
            content = [{"type": "output_audio", "transcript": self.text}]
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


class ConversationRecord:
    def __init__(self) -> None:
        self._items: dict[str, HistoryItem] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    @property
    def last_id(self) -> str | None:
        return next(reversed(self._items)) if self._items else None

    def add(self, item: HistoryItem) -> str | None:
        """Add an item; returns the previous item's id."""
        prev = self.last_id
        self._items[item.id] = item
        return prev

    def items(self) -> list[HistoryItem]:
        """In conversation order."""
        return list(self._items.values())

    def get(self, item_id: str) -> HistoryItem | None:
        return self._items.get(item_id)

    def delete(self, item_id: str) -> None:
        del self._items[item_id]
