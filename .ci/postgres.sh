# Start a throwaway PostgreSQL server on 127.0.0.1 for the multi-worker sweep tests. Source it (bash):
#
#     source .ci/postgres.sh        # exports DRAFTGYM_TEST_PG_URL; stop it with: draftgym_pg_stop
#
# Installs PostgreSQL with apt-get when no server binaries are found, runs initdb into a temporary folder (as the
# postgres user when we are root: initdb refuses root), starts the server on a free loopback port with its socket
# in that folder, creates a user and a database, and exports DRAFTGYM_TEST_PG_URL. Nothing listens beyond
# 127.0.0.1 and nothing outlives draftgym_pg_stop (the data folder is deleted).

_pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true; }

if [ -z "$(_pg_bin)" ] || [ ! -x "$(_pg_bin)/initdb" ]; then
    echo "== postgres: installing (apt-get)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
DRAFTGYM_PG_BIN="$(_pg_bin)"
DRAFTGYM_PG_DIR="$(mktemp -d /tmp/draftgym-pg.XXXXXX)"
DRAFTGYM_PG_PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

_pg_as() {  # run a server binary as the postgres user when root, else as ourselves
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$DRAFTGYM_PG_DIR"; fi
_pg_as "$DRAFTGYM_PG_BIN/initdb" -D "$DRAFTGYM_PG_DIR/data" -U postgres -A trust -E UTF8 >"$DRAFTGYM_PG_DIR/initdb.log"
_pg_as "$DRAFTGYM_PG_BIN/pg_ctl" -D "$DRAFTGYM_PG_DIR/data" -l "$DRAFTGYM_PG_DIR/server.log" -w \
    -o "-h 127.0.0.1 -p $DRAFTGYM_PG_PORT -k $DRAFTGYM_PG_DIR -c max_connections=200" start >/dev/null
_pg_as "$DRAFTGYM_PG_BIN/psql" -q -h 127.0.0.1 -p "$DRAFTGYM_PG_PORT" -U postgres -d postgres \
    -c "CREATE USER draftgym PASSWORD 'draftgym'" -c "CREATE DATABASE draftgym OWNER draftgym" >/dev/null

# +psycopg2: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; the test extra installs psycopg2-binary
export DRAFTGYM_TEST_PG_URL="postgresql+psycopg2://draftgym:draftgym@127.0.0.1:$DRAFTGYM_PG_PORT/draftgym"
echo "== postgres: $("$DRAFTGYM_PG_BIN/postgres" --version) on 127.0.0.1:$DRAFTGYM_PG_PORT (DRAFTGYM_TEST_PG_URL)"

draftgym_pg_stop() {
    _pg_as "$DRAFTGYM_PG_BIN/pg_ctl" -D "$DRAFTGYM_PG_DIR/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$DRAFTGYM_PG_DIR"
}
