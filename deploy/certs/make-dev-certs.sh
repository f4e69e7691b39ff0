#!/usr/bin/env bash
# Development CA and TLS certificates for tpflex -- NOT for production.
#
# usage: deploy/certs/make-dev-certs.sh [OUT_DIR]        (default: .certs, `make certs`)
#
# Writes into OUT_DIR (keys mode 0600, certificates 0644):
#   ca.pem ca-key.pem                  development CA (ECDSA P-256)
#   controller.pem controller-key.pem  CN=tpflex-controller  server+client (REST, trainer
#                                      stream, mTLS client of agents, etcd client)
#   agent.pem agent-key.pem            CN=tpflex-agent       server+client (gRPC, /metrics,
#                                      etcd client)
#   trainer.pem trainer-key.pem        CN=tpflex-trainer     client (plan stream)
#   etcd.pem etcd-key.pem              CN=etcd               server+client (client and peer URLs)
#   prometheus.pem prometheus-key.pem  CN=prometheus         client (scrapes)
# Every certificate has the SANs DNS:localhost, DNS:<CN>, IP:127.0.0.1 plus $TPFLEX_CERT_SANS.
#
# Idempotent: an existing pair is kept when its certificate chains to the CA, matches its
# key, still covers every requested SAN and is valid for at least 30 more days; otherwise
# it is (re)issued. A new CA (missing, expired or not matching its key) reissues everything.
#
# Environment:
#   TPFLEX_CERT_SANS  extra SANs for every certificate, comma-separated openssl syntax,
#                     e.g. "DNS:ctl1.example.org,IP:10.0.0.11"
#   TPFLEX_CERT_DAYS  leaf validity in days (default 365)
#   TPFLEX_CA_DAYS    CA validity in days (default 3650)
set -euo pipefail

OUT=${1:-.certs}
LEAF_DAYS=${TPFLEX_CERT_DAYS:-365}
CA_DAYS=${TPFLEX_CA_DAYS:-3650}
EXTRA_SANS=${TPFLEX_CERT_SANS:-}
RENEW_BEFORE_S=$((30 * 24 * 3600))

# name:common-name:extended-key-usage
IDENTITIES=(
  "controller:tpflex-controller:serverAuth,clientAuth"
  "agent:tpflex-agent:serverAuth,clientAuth"
  "trainer:tpflex-trainer:clientAuth"
  "etcd:etcd:serverAuth,clientAuth"
  "prometheus:prometheus:clientAuth"
)

# check_sans SANS: only DNS:name and IP:address entries (what covers_sans can check).
check_sans() {
  local san
  local -a given
  IFS=',' read -r -a given <<<"$1"
  for san in "${given[@]}"; do
    case $san in
      DNS:?* | IP:?*) ;;
      *) printf "make-dev-certs: unsupported SAN '%s' in TPFLEX_CERT_SANS (use DNS:name or IP:address)\n" "$san" >&2
         exit 2 ;;
    esac
  done
}
check_sans "$EXTRA_SANS"

umask 077
mkdir -p "$OUT"
WORK=$(mktemp -d "$OUT/.tmp.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

log() { printf 'make-dev-certs: %s\n' "$*" >&2; }

# key_matches_cert KEY CERT: the certificate carries the key's public half.
key_matches_cert() {
  [[ "$(openssl pkey -in "$1" -pubout 2>/dev/null)" == \
     "$(openssl x509 -in "$2" -noout -pubkey 2>/dev/null)" ]]
}

# still_valid CERT: not expiring within RENEW_BEFORE_S.
still_valid() { openssl x509 -in "$1" -noout -checkend "$RENEW_BEFORE_S" >/dev/null 2>&1; }

# covers_sans CERT SANS: every DNS:/IP: entry of SANS matches the certificate.
covers_sans() {
  local cert=$1 san kind value out
  local -a wanted
  IFS=',' read -r -a wanted <<<"$2"
  for san in "${wanted[@]}"; do
    kind=${san%%:*}
    value=${san#*:}
    case $kind in
      DNS) out=$(openssl x509 -in "$cert" -noout -checkhost "$value" 2>/dev/null) ;;
      IP) out=$(openssl x509 -in "$cert" -noout -checkip "$value" 2>/dev/null) ;;
      *) return 1 ;;
    esac
    [[ $out == *" does match certificate"* ]] || return 1
  done
}

ca_ok() {
  [[ -s "$OUT/ca.pem" && -s "$OUT/ca-key.pem" ]] &&
    key_matches_cert "$OUT/ca-key.pem" "$OUT/ca.pem" && still_valid "$OUT/ca.pem"
}

leaf_ok() {
  local name=$1 sans=$2
  [[ -s "$OUT/$name.pem" && -s "$OUT/$name-key.pem" ]] &&
    openssl verify -CAfile "$OUT/ca.pem" "$OUT/$name.pem" >/dev/null 2>&1 &&
    key_matches_cert "$OUT/$name-key.pem" "$OUT/$name.pem" &&
    still_valid "$OUT/$name.pem" && covers_sans "$OUT/$name.pem" "$sans"
}

make_ca() {
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
    -days "$CA_DAYS" -subj "/O=tpflex-dev/CN=tpflex development CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$WORK/ca-key.pem" -out "$WORK/ca.pem" 2>/dev/null
  chmod 0644 "$WORK/ca.pem"
  mv -f "$WORK/ca-key.pem" "$OUT/ca-key.pem"
  mv -f "$WORK/ca.pem" "$OUT/ca.pem"
  log "created CA out=$OUT/ca.pem"
}

make_leaf() {
  local name=$1 cn=$2 eku=$3 sans=$4
  cat >"$WORK/$name.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=$eku
subjectAltName=$sans
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
EOF
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/O=tpflex-dev/CN=$cn" -keyout "$WORK/$name-key.pem" -out "$WORK/$name.csr" 2>/dev/null
  openssl x509 -req -in "$WORK/$name.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca-key.pem" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$LEAF_DAYS" -sha256 \
    -extfile "$WORK/$name.ext" -out "$WORK/$name.pem" 2>/dev/null
  chmod 0644 "$WORK/$name.pem"
  mv -f "$WORK/$name-key.pem" "$OUT/$name-key.pem"
  mv -f "$WORK/$name.pem" "$OUT/$name.pem"
  log "issued certificate name=$name cn=$cn out=$OUT/$name.pem"
}

ca_ok || make_ca
for entry in "${IDENTITIES[@]}"; do
  IFS=':' read -r name cn eku <<<"$entry"
  sans="DNS:localhost,DNS:$cn,IP:127.0.0.1${EXTRA_SANS:+,$EXTRA_SANS}"
  leaf_ok "$name" "$sans" || make_leaf "$name" "$cn" "$eku" "$sans"
done
log "certificates up to date dir=$OUT"
