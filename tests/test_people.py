"""The people who sign in to the console, as the store keeps them and the admin API shows them,
through a real gateway on loopback, on SQLite and PostgreSQL: a sign-in made or updated in one
statement (two replicas at once, one row), the list in pages, one person, disabling and enabling
(an admin's, audited; a viewer's refused) and an unknown id. People are signed in by calling the
store, as the console's sign-in will."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from gateway.admin.openapi import OPENAPI
from gateway.storage import open_store
from tests.support import SetClock, make_config
from tests.test_admin_api import ADMIN, VIEWER_TOKEN, Admin, assert_error


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.services)])
def storage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ezat.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def admin(start_gateway, upstream, storage_url) -> Admin:
    return Admin(await start_gateway(replace(make_config(upstream.url, storage_url), admin=ADMIN)))


@pytest.fixture
def clock() -> SetClock:
    return SetClock("2026-12-01T09:00:00+00:00")


@pytest.fixture
async def stores(admin, storage_url, clock):
    """Opens stores on the gateway's database (as the console's sign-in of another replica would
    write), each with `clock`, and closes them at the end of the test."""
    opened = []

    async def open_():
        store = open_store(storage_url, now=clock)
        await store.open()
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()


async def test_a_sign_in_makes_a_person_and_the_next_one_updates_them(admin, stores, clock):
    store = await stores()
    alice = await store.person_signed_in("idp|alice", "alice@example.com", "Alice", ["eng", "admins"])
    bob = await store.person_signed_in("idp|bob", "bob@example.com", "Bob", [])

    listed = await admin.ok("GET", "/people", token=VIEWER_TOKEN)  # a viewer reads
    assert listed == {
        "data": [
            {
                "id": alice.id,
                "subject": "idp|alice",
                "email": "alice@example.com",
                "name": "Alice",
                "groups": ["eng", "admins"],
                "first_seen": "2026-12-01T09:00:00+00:00",
                "last_seen": "2026-12-01T09:00:00+00:00",
                "disabled": False,
            },
            {
                "id": bob.id,
                "subject": "idp|bob",
                "email": "bob@example.com",
                "name": "Bob",
                "groups": [],
                "first_seen": "2026-12-01T09:00:00+00:00",
                "last_seen": "2026-12-01T09:00:00+00:00",
                "disabled": False,
            },
        ],
        "next": None,
    }
    assert set(listed["data"][0]) == set(OPENAPI["components"]["schemas"]["Person"]["properties"])

    # A day later Alice signs in again, out of the admins' group and renamed: the same person,
    # first seen when she was, last seen now, with the groups she is in now.
    clock.set("2026-12-02T10:30:00+00:00")
    again = await store.person_signed_in("idp|alice", "alice@corp.example", "Alice Liddell", ("eng",))
    assert again.id == alice.id
    assert (again.email, again.name, again.groups) == ("alice@corp.example", "Alice Liddell", ("eng",))
    assert (again.first_seen, again.last_seen) == (alice.first_seen, clock())
    shown = await admin.ok("GET", f"/people/{alice.id}", token=VIEWER_TOKEN)
    assert (shown["groups"], shown["first_seen"], shown["last_seen"]) == (
        ["eng"],
        "2026-12-01T09:00:00+00:00",
        "2026-12-02T10:30:00+00:00",
    )
    assert await store.find_person_by_subject("idp|alice") == again
    assert await store.find_person(alice.id) == again
    assert await store.find_person_by_subject("idp|nobody") is None
    assert len((await admin.ok("GET", "/people"))["data"]) == 2  # no second row

    # A sign-in is no change an administrator made: the audit log holds none of it.
    assert (await admin.ok("GET", "/audit"))["data"] == []
    # One string is not a list of groups (it would be read as its letters).
    with pytest.raises(TypeError, match="groups"):
        await store.person_signed_in("idp|carol", "carol@example.com", "Carol", "eng")  # type: ignore[arg-type]
    assert await store.find_person_by_subject("idp|carol") is None


async def test_people_come_in_pages_by_id(admin, stores):
    store = await stores()
    for name in ("ann", "ben", "cat", "dan", "eve"):
        await store.person_signed_in(f"idp|{name}", f"{name}@example.com", name, [])
    names, cursor, pages = [], "", 0
    while cursor is not None:
        page = await admin.ok("GET", f"/people?limit=2{cursor and '&after=' + cursor}")
        assert len(page["data"]) <= 2
        names += [person["name"] for person in page["data"]]
        cursor, pages = page["next"], pages + 1
    assert (names, pages) == (["ann", "ben", "cat", "dan", "eve"], 3)
    # A page that holds exactly the rest says there is none after it.
    assert (await admin.ok("GET", "/people?limit=5"))["next"] is None
    first_two = await admin.ok("GET", "/people?limit=2")
    assert first_two["next"] == str(first_two["data"][1]["id"])
    assert_error(await admin.call("GET", "/people?limit=0"), 400, "invalid_request_error", "limit: expected")
    assert_error(await admin.call("GET", "/people?after=x"), 400, "invalid_request_error", "after: expected")


async def test_an_admin_disables_and_enables_a_person_and_the_audit_log_says_who(admin, stores, clock):
    store = await stores()
    person = await store.person_signed_in("idp|mallory", "mallory@example.com", "Mallory", ["eng"])

    disabled = await admin.ok("POST", f"/people/{person.id}/disable")
    assert (disabled["id"], disabled["disabled"]) == (person.id, True)
    assert (await admin.ok("GET", f"/people/{person.id}"))["disabled"] is True
    # Disabling one disabled already changes nothing, and writes no entry.
    assert (await admin.ok("POST", f"/people/{person.id}/disable"))["disabled"] is True
    # Signing in again does not enable them.
    clock.set("2026-12-03T08:00:00+00:00")
    assert (await store.person_signed_in("idp|mallory", "mallory@example.com", "Mallory", ["eng"])).disabled is True

    enabled = await admin.ok("POST", f"/people/{person.id}/enable")
    assert (enabled["disabled"], enabled["last_seen"]) == (False, "2026-12-03T08:00:00+00:00")
    assert (await store.find_person(person.id)).disabled is False

    entries = (await admin.ok("GET", "/audit"))["data"]
    assert [(e["action"], e["actor"], e["target"]) for e in reversed(entries)] == [
        ("person.disable", "root", f"person:{person.id}"),
        ("person.enable", "root", f"person:{person.id}"),
    ]
    disable, enable = reversed(entries)
    assert (disable["before"]["disabled"], disable["after"]["disabled"]) == (False, True)
    assert (enable["before"]["disabled"], enable["after"]["disabled"]) == (True, False)
    assert disable["after"]["email"] == "mallory@example.com"


async def test_a_viewer_may_not_disable_a_person(admin, stores):
    store = await stores()
    person = await store.person_signed_in("idp|dave", "dave@example.com", "Dave", [])
    for action in ("disable", "enable"):
        assert_error(
            await admin.call("POST", f"/people/{person.id}/{action}", token=VIEWER_TOKEN),
            403,
            "permission_error",
            "'watcher' is a viewer's",
        )
    assert (await store.find_person(person.id)).disabled is False
    assert (await admin.ok("GET", "/audit"))["data"] == []


@pytest.mark.parametrize(
    "method, path, words",
    [
        ("GET", "/people/999999", "no person numbered '999999'"),
        ("GET", "/people/abc", "no person numbered 'abc'"),
        ("GET", "/people/99999999999999999999", "no person numbered '99999999999999999999'"),
        ("POST", "/people/999999/disable", "no person numbered '999999'"),
        ("POST", "/people/999999/enable", "no person numbered '999999'"),
    ],
)
async def test_an_unknown_person_is_a_404(admin, method, path, words):
    assert_error(await admin.call(method, path), 404, "not_found_error", words)
    assert (await admin.ok("GET", "/audit"))["data"] == []


async def test_two_replicas_signing_one_person_in_at_once_both_succeed_with_one_row(admin, stores):
    """Each round, two stores on the one database (two replicas) sign a new person in at the same
    moment, twice each: every sign-in succeeds and finds the same row."""
    first, second = await stores(), await stores()
    for turn in range(20):
        subject = f"idp|racer-{turn}"
        signed_in = await asyncio.gather(
            *(
                store.person_signed_in(subject, f"racer{turn}@example.com", "Racer", ["eng"])
                for store in (first, second) * 2
            )
        )
        assert len({person.id for person in signed_in}) == 1, signed_in
    people = (await admin.ok("GET", "/people?limit=1000"))["data"]
    assert sorted(person["subject"] for person in people) == sorted(f"idp|racer-{turn}" for turn in range(20))
