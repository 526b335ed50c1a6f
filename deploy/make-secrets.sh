#!/usr/bin/env bash
# Make the TLS files and tokens a secured tierps cluster mounts (deploy/README.md, Security):
#
#     deploy/make-secrets.sh deploy/secrets [extra server name ...]
#
# writes into the directory: ca.crt/ca.key (a private CA: keep ca.key offline), tls.crt /
# tls.key (the shards' certificate, for the names below), client.crt / client.key (a client
# certificate for mutual TLS), tokens (the shards' ROLE:TOKEN lines) and admin_token,
# trainer_token, reader_token (one token each, for the clients). The server certificate
# names localhost, 127.0.0.1, shard-0..shard-7 (compose) and *.tierps, *.tierps.<ns>.svc,
# *.tierps.<ns>.svc.cluster.local for NAMESPACE (default "default"), plus any extra names.
# Existing files are kept: delete one to make it again.
#
# Modes: ca.key 0600; tls.key, client.key, tokens and *_token 0640, readable by their group
# (SECRETS_GROUP, default your primary group), which compose's shards join (group_add) to
# read them as the image's user; certificates 0644. Everything stays writable by you, so a
# token is rotated in place (deploy/README.md). For deploy/secrets, the group's id goes to
# deploy/.env (TIERPS_SECRETS_GID), which compose reads. A directory inside a git work tree
# that git does not ignore is refused: deploy/secrets is ignored.
set -euo pipefail
dir=${1:?usage: make-secrets.sh DIR [extra server name ...] (deploy/README.md: deploy/secrets)}
shift
ns=${NAMESPACE:-default}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
umask 077  # nothing made here is readable by others, not even for a moment

made_dir=
[[ -d $dir ]] || { mkdir -p "$dir"; made_dir=1; }
if command -v git > /dev/null && git -C "$dir" rev-parse --is-inside-work-tree > /dev/null 2>&1 \
  && ! git -C "$dir" check-ignore -q tokens; then
  top=$(git -C "$dir" rev-parse --show-toplevel)
  [[ -z $made_dir ]] || rmdir "$dir"
  echo "make-secrets.sh: expected a directory git ignores (deploy/secrets is), got $dir:" \
    "it is inside the git work tree $top and not ignored, so the keys and tokens could be" \
    "committed" >&2
  exit 2
fi
cd "$dir"
dir=$(pwd)

if [[ ! -f ca.key ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
    -subj "/CN=tierps CA" -keyout ca.key -out ca.crt
fi

sign() {  # sign NAME CN EXTENSIONS
  [[ -f $1.crt ]] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 397 \
    -out "$1.crt" -extfile <(printf '%s\n' "$3")
  rm -f "$1.csr"
}

names="DNS:localhost,IP:127.0.0.1,DNS:*.tierps,DNS:*.tierps.$ns.svc"
names+=",DNS:*.tierps.$ns.svc.cluster.local"
for i in 0 1 2 3 4 5 6 7; do names+=",DNS:shard-$i"; done
for extra in "$@"; do names+=",DNS:$extra"; done
sign tls "tierps shard" "subjectAltName=$names
extendedKeyUsage=serverAuth"
sign client "tierps client" "extendedKeyUsage=clientAuth"

for role in admin trainer reader; do
  [[ -f ${role}_token ]] || openssl rand -hex 32 > "${role}_token"
done
if [[ ! -f tokens ]]; then
  for role in admin trainer reader; do echo "$role:$(cat "${role}_token")"; done > tokens
fi

shared=(tls.key client.key tokens admin_token trainer_token reader_token)
[[ -z ${SECRETS_GROUP:-} ]] || chgrp "$SECRETS_GROUP" . "${shared[@]}"
chmod 0750 .
chmod 0600 ca.key
[[ ! -f ca.srl ]] || chmod 0600 ca.srl
chmod 0640 "${shared[@]}"
chmod 0644 ./*.crt
gid=$(stat -c %g tokens 2> /dev/null || stat -f %g tokens)  # GNU, else BSD stat

if [[ $dir == "$here/secrets" ]]; then  # compose's secrets: tell it the group to join
  env_file="$here/.env"
  kept=$(grep -v '^TIERPS_SECRETS_GID=' "$env_file" 2> /dev/null || true)
  new_env=$([[ -f $env_file ]] || echo yes)
  printf '%s%sTIERPS_SECRETS_GID=%s\n' "$kept" "${kept:+$'\n'}" "$gid" > "$env_file"
  [[ -z $new_env ]] || chmod 0644 "$env_file"  # a .env there keeps its mode (it may hold secrets)
fi
echo "secrets in $dir: ca.crt tls.crt tls.key client.crt client.key tokens *_token" \
  "(keys and tokens 0640, group $gid; ca.key 0600: keep it offline)"
