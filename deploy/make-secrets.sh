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
# Existing files are kept: delete one to make it again (a token rotation: README).
set -euo pipefail
dir=${1:?usage: make-secrets.sh DIR [extra server name ...]}
shift
ns=${NAMESPACE:-default}
mkdir -p "$dir"
cd "$dir"
umask 077

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
chmod 0444 ./*.crt  # the shards run as uid 10001: they must read what compose mounts
chmod 0444 tls.key client.key tokens ./*_token
echo "secrets in $dir: ca.crt tls.crt tls.key client.crt client.key tokens *_token"
