#!/usr/bin/env bash
# Install the DFlash systemd units for this checkout (`make install-systemd`).
#
#   deploy/systemd/install.sh [--user] [--dest DIR] [--env-file FILE] [--service-user NAME] [--no-reload]
#
#   (default)        system units in /etc/systemd/system, environment file /etc/dflash/dflash.env
#                    (needs root; the services run as --service-user, default $SUDO_USER)
#   --user           user units in ~/.config/systemd/user, environment file ~/.config/dflash/dflash.env
#   --dest DIR       write the units to DIR instead (no daemon-reload); for packaging and tests
#   --env-file FILE  where the units read their environment from
#   --no-reload      skip `systemctl daemon-reload`
#
# The units point at this checkout (deploy/run_process.sh). The environment file
# is created from dflash.env.example only when it does not exist yet.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOME_DIR=$(cd "$HERE/../.." && pwd)
UNITS=(dflash-target.service dflash-metrics.service "dflash-drafter@.service"
       "dflash-target@.service" "dflash-drafter-group@.service")

scope=system
dest=""
env_file=""
service_user=${SUDO_USER:-}
reload=1
while [ $# -gt 0 ]; do
    case "$1" in
        --user) scope=user ;;
        --system) scope=system ;;
        --dest) dest=$2; reload=0; shift ;;
        --env-file) env_file=$2; shift ;;
        --service-user) service_user=$2; shift ;;
        --no-reload) reload=0 ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

config_home=${XDG_CONFIG_HOME:-$HOME/.config}
if [ "$scope" = user ]; then
    dest=${dest:-$config_home/systemd/user}
    env_file=${env_file:-$config_home/dflash/dflash.env}
    wanted_by=default.target
    systemctl_cmd=(systemctl --user)
    service_user=""  # user units always run as the user
else
    dest=${dest:-/etc/systemd/system}
    env_file=${env_file:-/etc/dflash/dflash.env}
    wanted_by=multi-user.target
    systemctl_cmd=(systemctl)
fi
case "$env_file" in
    /*) ;;
    *) env_file="$(pwd)/$env_file" ;;
esac

# sed replacement text: escape \, & and the | delimiter.
esc() { printf '%s' "$1" | sed -e 's/[\\&|]/\\&/g'; }
render() {
    sed -e "s|@DFLASH_HOME@|$(esc "$HOME_DIR")|g" \
        -e "s|@ENV_FILE@|$(esc "$env_file")|g" \
        -e "s|@WANTED_BY@|$(esc "$wanted_by")|g" "$1"
}

if ! mkdir -p "$dest" 2>/dev/null || [ ! -w "$dest" ]; then
    echo "install.sh: cannot write to $dest; run as root (sudo make install-systemd) or use --user" >&2
    exit 2
fi
for unit in "${UNITS[@]}"; do
    if [ -n "$service_user" ]; then
        # The services run as the invoking user, not root.
        render "$HERE/$unit" | sed -e "s|^\[Service\]$|[Service]\nUser=$(esc "$service_user")|" > "$dest/$unit.tmp"
    else
        render "$HERE/$unit" > "$dest/$unit.tmp"
    fi
    chmod 0644 "$dest/$unit.tmp"
    mv "$dest/$unit.tmp" "$dest/$unit"
    echo "installed $dest/$unit"
done

if [ -e "$env_file" ]; then
    echo "kept existing environment file $env_file"
else
    mkdir -p "$(dirname "$env_file")"
    render "$HERE/dflash.env.example" > "$env_file"
    chmod 0644 "$env_file"
    if [ -n "$service_user" ] && [ "$(id -u)" = 0 ]; then
        chown "$service_user" "$env_file" 2>/dev/null || true
    fi
    echo "wrote environment file $env_file (edit DFLASH_CONFIG, DFLASH_RUN_NAME and the GPU lines)"
fi

if [ ! -x "$HOME_DIR/.venv/bin/python" ]; then
    echo "install.sh: note: $HOME_DIR/.venv does not exist yet; run 'make venv' as the service user, or set DFLASH_VENV in $env_file" >&2
fi

if [ "$reload" = 1 ]; then
    if command -v systemctl >/dev/null 2>&1; then
        "${systemctl_cmd[@]}" daemon-reload || echo "install.sh: '${systemctl_cmd[*]} daemon-reload' failed; run it yourself" >&2
    else
        echo "install.sh: systemctl not found; reload the systemd manager yourself" >&2
    fi
fi

sc="${systemctl_cmd[*]}"
jc=$([ "$scope" = user ] && echo "journalctl --user" || echo journalctl)
cat <<EOF

next:
  $sc start dflash-metrics dflash-target dflash-drafter@1 dflash-drafter@2
  $sc restart dflash-drafter@1          # after changing its code or [drafters.1]
  $jc -fu dflash-metrics                 # the sidecar's log
  $sc enable dflash-metrics dflash-target dflash-drafter@1   # start at boot
several target replicas and a torchrun drafter (e.g. configs/node-8gpu.toml):
  python -m deploy.node --config CONFIG --check --env-file $env_file   # the layout, checked
  $sc start dflash-metrics dflash-target@{0..4} dflash-drafter-group@g0
EOF
if [ "$scope" = system ] && [ -z "$service_user" ]; then
    echo "note: no --service-user given and no \$SUDO_USER: the services run as root" >&2
fi
