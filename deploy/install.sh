#!/usr/bin/env bash
# Installs nemotron-gateway as two systemd services on a Debian/Ubuntu machine; idempotent.
#
#   sudo deploy/install.sh                 install (or upgrade) from this checkout, enable the units
#   sudo deploy/install.sh --start         ... and start them
#   sudo deploy/install.sh --uninstall     stop and remove units, venv and nginx site; keeps the env file,
#                                          the models and the `nemotron` user (--purge removes those too)
#
# What it does: the `nemotron` system user; /etc/nemotron-gateway/env (every setting, commented, with a
# generated auth secret; an existing file is kept); a venv in /opt/nemotron-gateway with the package and
# the `gpu` extra where an NVIDIA GPU is present; redis-server (apt) when missing; the units
# nemotron-engine.service, nemotron-gateway.socket and nemotron-gateway.service, enabled; the nginx site
# in sites-available when nginx is installed. Then it prints the next steps (first key, a curl).
#
# Options: --package SPEC (a wheel, sdist or directory; default this checkout), --wheelhouse DIR (install
# offline from DIR only), --extra NAME (gpu, cpu or none; default: gpu when `nvidia-smi -L` lists a GPU),
# --prefix DIR (default /opt/nemotron-gateway), --start, --uninstall, --purge.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PACKAGE=$(dirname "$HERE")
PREFIX=/opt/nemotron-gateway
CONF_DIR=/etc/nemotron-gateway
UNIT_DIR=/etc/systemd/system
MODELS=/srv/models
USER_NAME=nemotron
UNITS=(nemotron-engine.service nemotron-gateway.socket nemotron-gateway.service)
TEMPLATE_UNIT=nemotron-engine@.service
WHEELHOUSE=""
EXTRA=auto
START=no
ACTION=install
PURGE=no

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --package) PACKAGE=$2; shift 2 ;;
        --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
        --extra) EXTRA=$2; shift 2 ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --start) START=yes; shift ;;
        --uninstall) ACTION=uninstall; shift ;;
        --purge) PURGE=yes; shift ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage 2 >&2 ;;
    esac
done

say() { printf '==> %s\n' "$*"; }

if [[ $EUID -ne 0 ]]; then
    echo "install.sh: run it as root (sudo $0 $*)" >&2
    exit 2
fi

uninstall() {
    say "stopping and disabling ${UNITS[*]}"
    systemctl disable --now "${UNITS[@]}" 2>/dev/null || true
    # Every instance of the per-replica template, enabled or running.
    systemctl stop "nemotron-engine@*.service" 2>/dev/null || true
    for link in "$UNIT_DIR"/*.wants/nemotron-engine@*.service; do
        [[ -e $link || -L $link ]] && systemctl disable "$(basename "$link")" 2>/dev/null || true
    done
    rm -f "$UNIT_DIR/$TEMPLATE_UNIT"
    for unit in "${UNITS[@]}"; do
        rm -f "$UNIT_DIR/$unit"
    done
    systemctl daemon-reload
    systemctl reset-failed "${UNITS[@]}" 2>/dev/null || true
    rm -f /etc/nginx/sites-enabled/nemotron-gateway /etc/nginx/sites-available/nemotron-gateway
    say "removing $PREFIX"
    rm -rf "$PREFIX"
    if [[ $PURGE == yes ]]; then
        say "purging $CONF_DIR, /var/lib/nemotron-gateway, /var/cache/nemotron-gateway and the $USER_NAME user"
        rm -rf "$CONF_DIR" /var/lib/nemotron-gateway /var/cache/nemotron-gateway
        if getent passwd "$USER_NAME" >/dev/null; then
            userdel "$USER_NAME"
        fi
    else
        say "kept $CONF_DIR (keys' secret), $MODELS and the $USER_NAME user; --purge removes them"
    fi
}

# Every setting as a commented line with its description and default, from the installed package itself,
# so the file cannot drift from gateway/settings.py.
settings_reference() {
    "$PREFIX/.venv/bin/python" - <<'PY'
from pydantic import BaseModel

from gateway.settings import ENV_PREFIX, Settings


def lines(prefix: str, model: type[BaseModel]) -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += ["", f"# --- {(annotation.__doc__ or name).strip().splitlines()[0]}"]
            out += lines(f"{prefix}{name.upper()}__", annotation)
            continue
        default = info.get_default(call_default_factory=True)
        shown = "" if default is None else default
        if isinstance(shown, (list, tuple)):
            shown = ",".join(map(str, shown))
        out.append(f"# {info.description or ''}".rstrip())
        out.append(f"#{prefix}{name.upper()}={str(shown).lower() if isinstance(shown, bool) else shown}")
    return out


print("\n".join(lines(ENV_PREFIX.upper(), Settings)))
PY
}

random_hex() {
    openssl rand -hex 32 2>/dev/null || "$PREFIX/.venv/bin/python" -c 'import secrets; print(secrets.token_hex(32))'
}

write_env_file() {
    local env=$CONF_DIR/env secret engine_key
    install -d -m 0750 -o root -g "$USER_NAME" "$CONF_DIR"
    if [[ -f $env ]]; then
        say "keeping $env (delete it to have it written anew)"
        return
    fi
    secret=$(random_hex)
    engine_key=$(random_hex)
    say "writing $env with a new auth secret and engine key"
    umask 027
    {
        echo "# /etc/nemotron-gateway/env: the settings of nemotron-engine.service and nemotron-gateway.service."
        echo "# Change a value, then: systemctl restart nemotron-gateway (and nemotron-engine for ENGINE__ settings)."
        echo "# The gateway listens where nemotron-gateway.socket says (ListenStream=); NEMOTRON_HOST/PORT apply by hand."
        echo
        echo "NEMOTRON_ENGINE__MODEL=$MODELS/Nemotron-Mini-4B-Instruct"
        echo "NEMOTRON_ENGINE__PROFILE=balanced"
        echo "NEMOTRON_ENGINE__SERVED_MODEL_NAME=nemotron"
        echo "NEMOTRON_ENGINE__PORT=8001"
        echo "NEMOTRON_ENGINE_URL=http://127.0.0.1:8001"
        echo "NEMOTRON_REDIS_URL=redis://127.0.0.1:6379/0"
        echo "# Where the engine unit keeps its status (RuntimeDirectory=); hand-run status and doctor read it here."
        echo "NEMOTRON_ENGINE__STATE_DIR=/run/nemotron-gateway"
        echo "# The HMAC key of API keys in Redis: changing it invalidates every key."
        echo "NEMOTRON_AUTH__SECRET=$secret"
        echo "# The engine's own key (vLLM gets it as VLLM_API_KEY): no other local user can call its port directly."
        echo "NEMOTRON_ENGINE_API_KEY=$engine_key"
        echo
        echo "# ---------------------------------------------------------------------------------------------"
        echo "# Every setting, with its default (uncomment to change). Generated from gateway/settings.py."
        settings_reference
    } >"$env.new"
    chown root:"$USER_NAME" "$env.new"
    chmod 0640 "$env.new"
    mv "$env.new" "$env"
}

choose_extra() {
    if [[ $EXTRA != auto ]]; then
        echo "$EXTRA"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        echo gpu
    else
        echo none
    fi
}

install_package() {
    local extra spec pip_args=()
    extra=$(choose_extra)
    command -v python3 >/dev/null || { echo "install.sh: python3 missing: apt-get install python3 python3-venv" >&2; exit 2; }
    if [[ ! -x $PREFIX/.venv/bin/python ]]; then
        say "creating the venv $PREFIX/.venv"
        install -d -m 0755 "$PREFIX"
        python3 -m venv "$PREFIX/.venv" || { echo "install.sh: apt-get install python3-venv, then run me again" >&2; exit 2; }
    fi
    spec=$PACKAGE
    [[ $extra != none ]] && spec="$PACKAGE[$extra]"
    if [[ -n $WHEELHOUSE ]]; then
        pip_args+=(--no-index --find-links "$WHEELHOUSE")
    fi
    say "installing $spec into $PREFIX/.venv (extra: $extra)"
    "$PREFIX/.venv/bin/pip" install --quiet --disable-pip-version-check "${pip_args[@]}" --upgrade "$spec"
}

install_redis() {
    if ! command -v redis-server >/dev/null; then
        if command -v apt-get >/dev/null; then
            say "installing redis-server"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
        else
            echo "install.sh: no redis-server; install Redis and set NEMOTRON_REDIS_URL" >&2
        fi
    fi
    if systemctl list-unit-files redis-server.service >/dev/null 2>&1; then
        systemctl enable --quiet redis-server.service || true
    fi
}

install_units() {
    say "installing ${UNITS[*]} into $UNIT_DIR"
    for unit in "${UNITS[@]}"; do
        sed "s#/opt/nemotron-gateway/#$PREFIX/#g" "$HERE/systemd/$unit" >"$UNIT_DIR/$unit.new"
        chmod 0644 "$UNIT_DIR/$unit.new"
        mv "$UNIT_DIR/$unit.new" "$UNIT_DIR/$unit"
    done
    # The per-replica template (several engine replicas on one host) is installed, not enabled: see its header.
    sed "s#/opt/nemotron-gateway/#$PREFIX/#g" "$HERE/systemd/$TEMPLATE_UNIT" >"$UNIT_DIR/$TEMPLATE_UNIT.new"
    chmod 0644 "$UNIT_DIR/$TEMPLATE_UNIT.new"
    mv "$UNIT_DIR/$TEMPLATE_UNIT.new" "$UNIT_DIR/$TEMPLATE_UNIT"
    systemctl daemon-reload
    systemctl enable --quiet "${UNITS[@]}"
    if [[ -d /etc/nginx/sites-available ]]; then
        install -m 0644 "$HERE/nginx/nemotron-gateway.conf" /etc/nginx/sites-available/nemotron-gateway
    fi
}

do_install() {
    if ! getent passwd "$USER_NAME" >/dev/null; then
        say "creating the system user $USER_NAME"
        useradd --system --home-dir /var/lib/nemotron-gateway --no-create-home --shell /usr/sbin/nologin "$USER_NAME"
    fi
    install -d -m 0755 -o "$USER_NAME" -g "$USER_NAME" "$MODELS"
    install_package
    write_env_file
    install_redis
    install_units
    if [[ $START == yes ]]; then
        say "starting redis-server, nemotron-engine and nemotron-gateway"
        systemctl start redis-server.service 2>/dev/null || true
        systemctl restart nemotron-engine.service nemotron-gateway.socket nemotron-gateway.service
    elif systemctl is-active --quiet nemotron-gateway.service; then
        # An upgrade: the running processes still run the old code until they are restarted.
        say "restarting the running services onto the new code"
        systemctl restart nemotron-gateway.service
        systemctl try-restart nemotron-engine.service
    fi
    cat <<EOF

nemotron-gateway is installed. Next steps:
  1. Put the model in $MODELS (or set NEMOTRON_ENGINE__MODEL in $CONF_DIR/env), then
       systemctl start nemotron-engine nemotron-gateway
       journalctl -u nemotron-engine -f        # until "engine ready"
  2. The first API key (printed once, on the last line):
       $PREFIX/.venv/bin/nemotron-gateway keys create --name first --env-file $CONF_DIR/env
  3. A request:
       curl -s http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer sk-..." \\
         -H 'Content-Type: application/json' -d '{"model":"nemotron","messages":[{"role":"user","content":"Hi"}]}'
  4. HTTPS: a certificate in $CONF_DIR/tls/ (fullchain.pem, privkey.pem), then
       ln -s /etc/nginx/sites-available/nemotron-gateway /etc/nginx/sites-enabled/ && systemctl reload nginx
EOF
}

if [[ $ACTION == uninstall ]]; then
    uninstall
else
    do_install
fi
