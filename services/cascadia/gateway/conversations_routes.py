"""OpenAI's Conversations API (`/v1/conversations`): items that responses naming the conversation read
before their input and add their input and output to, kept in the gateway's store like responses."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import FastAPI

from cascadia.gateway.auth import Key
from cascadia.gateway.errors import ApiError
from cascadia.gateway.response_store import ResponseStore, StoredConversation
from cascadia.gateway.responses import listed_items, refuse_unsupported_items
from cascadia.gateway.responses_routes import ItemPage, conversation_not_found, store_answering
from cascadia.gateway.responses_schemas import (
    ConversationBody,
    ConversationCreate,
    ConversationUpdate,
    DeletedConversation,
    InputItemList,
    ItemsCreate,
)
from cascadia.gateway.schemas import error_responses


def add_conversation_routes(app: FastAPI, store: ResponseStore) -> None:
    one = "/v1/conversations/{conversation_id}"
    found = error_responses(401, 404, 503)

    async def existing(conversation_id: str, key: str) -> StoredConversation:
        with store_answering():
            stored = await store.get_conversation(conversation_id, key)
        if stored is None:
            raise conversation_not_found(conversation_id)
        return stored

    @app.post("/v1/conversations", response_model=ConversationBody, responses=error_responses(400, 401, 503))
    async def create_conversation(body: ConversationCreate, key: Key) -> Any:
        refuse_unsupported_items(body.items or [], "items")
        stored = StoredConversation(key, f"conv_{uuid.uuid4().hex}", int(time.time()), body.metadata or {})
        with store_answering():
            await store.put_conversation(stored, listed_items(body.items or []))
        return stored.body()

    @app.get(one, response_model=ConversationBody, responses=found)
    async def retrieve_conversation(conversation_id: str, key: Key) -> Any:
        return (await existing(conversation_id, key)).body()

    @app.post(one, response_model=ConversationBody, responses=error_responses(400, 401, 404, 503))
    async def update_conversation(conversation_id: str, body: ConversationUpdate, key: Key) -> Any:
        stored = dataclasses.replace(await existing(conversation_id, key), metadata=body.metadata)
        with store_answering():
            await store.put_conversation(stored, [])
        return stored.body()

    @app.delete(one, response_model=DeletedConversation, responses=found)
    async def delete_conversation(conversation_id: str, key: Key) -> DeletedConversation:
        with store_answering():
            if not await store.delete_conversation(conversation_id, key):
                raise conversation_not_found(conversation_id)
        return DeletedConversation(id=conversation_id)

    @app.get(one + "/items", response_model=InputItemList, responses=error_responses(400, 401, 404, 503))
    async def list_items(conversation_id: str, key: Key, page: ItemPage) -> InputItemList:
        with store_answering():
            items = await store.items(conversation_id, key)
        if items is None:
            raise conversation_not_found(conversation_id)
        return page.of(items)

    @app.post(one + "/items", response_model=InputItemList, responses=error_responses(400, 401, 404, 503))
    async def add_items(conversation_id: str, body: ItemsCreate, key: Key) -> InputItemList:
        refuse_unsupported_items(body.items, "items")
        added = listed_items(body.items)
        with store_answering():
            if not await store.add_items(conversation_id, key, added):
                raise conversation_not_found(conversation_id)
        return InputItemList(data=added, first_id=added[0]["id"], last_id=added[-1]["id"], has_more=False)

    @app.get(one + "/items/{item_id}", responses=found)
    async def retrieve_item(conversation_id: str, item_id: str, key: Key) -> dict[str, Any]:
        with store_answering():
            items = await store.items(conversation_id, key)
        if items is None:
            raise conversation_not_found(conversation_id)
        for item in items:
            if item["id"] == item_id:
                return item
        raise _item_not_found(conversation_id, item_id)

    @app.delete(one + "/items/{item_id}", response_model=ConversationBody, responses=found)
    async def delete_item(conversation_id: str, item_id: str, key: Key) -> Any:
        stored = await existing(conversation_id, key)
        with store_answering():
            if not await store.delete_item(conversation_id, key, item_id):
                raise _item_not_found(conversation_id, item_id)
        return stored.body()


def _item_not_found(conversation_id: str, item_id: str) -> ApiError:
    return ApiError(404, f"Conversation '{conversation_id}' has no item '{item_id}'.", code="item_not_found")
