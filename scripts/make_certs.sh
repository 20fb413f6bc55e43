#!/usr/bin/env bash
# Makes the certificates for mutual TLS between decode and prefill nodes, with openssl:
#
#   OUT_DIR/ca.crt, ca.key            a private CA (its key signs; no node needs it)
#   OUT_DIR/prefill/tls.crt, tls.key  prefill server certificate: serverAuth, SANs = the
#                                     --prefill-names, localhost and 127.0.0.1
#   OUT_DIR/decode/tls.crt, tls.key   decode client certificate: clientAuth
#   OUT_DIR/{prefill,decode}/ca.crt   the CA certificate, beside each identity
#
# Each identity folder has the shape of a kubernetes.io/tls Secret as cert-manager writes it
# (tls.crt, tls.key, ca.crt), so deploy/k8s/tls-secrets.sh turns it into one as it is, and the
# nodes take the same paths in both deployments:
#   kvwire-prefill --tls-cert=prefill/tls.crt --tls-key=prefill/tls.key --tls-client-ca=prefill/ca.crt
#   kvwire-decode  --prefill-tls-ca=decode/ca.crt --prefill-tls-cert=decode/tls.crt \
#                  --prefill-tls-key=decode/tls.key
#
# Keys are ECDSA P-256: as strong as RSA-3072 for a fraction of the size and signing time
# (each new connection signs once per handshake), and supported by every TLS stack on the path
# (gRPC with OpenSSL, Python's grpcio, cert-manager's `algorithm: ECDSA`, size 256).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/make_certs.sh OUT_DIR [--prefill-names NAME,...] [--days N] [--force] [--new-ca]

Makes (or keeps) a CA, a prefill server certificate and a decode client certificate for mutual
TLS between the nodes, in OUT_DIR: ca.crt ca.key, prefill/{tls.crt,tls.key,ca.crt},
decode/{tls.crt,tls.key,ca.crt}. Keys are ECDSA P-256, mode 600.

options:
  --prefill-names A,B   DNS names or IP addresses the decode nodes use to reach the prefill
                        nodes (e.g. kvwire-prefill, the headless Service), added to the prefill
                        certificate's SANs with localhost and 127.0.0.1
  --days N              validity of the node certificates in days (default 365); the CA's is
                        10 years, or N days if longer
  --force               reissue the node certificates (new keys), signed by the existing CA:
                        nodes holding the old ones still trust the new ones (rotation)
  --new-ca              make a new CA too, and reissue everything (every node must get the new
                        files before it talks to the others again)

Without --force, what exists is kept if it is usable (signed by OUT_DIR's CA, not expired, the
prefill certificate covering the names asked for); otherwise the script says why and stops.
EOF
}

die() {
  echo "make_certs.sh: error: $*" >&2
  exit 1
}
say() { echo "make_certs.sh: $*"; }

# ---- options ------------------------------------------------------------------------------

OUT=""
NAMES=""
DAYS=365
FORCE=0
NEW_CA=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --prefill-names) NAMES=${2?--prefill-names needs a value}; shift 2 ;;
    --days) DAYS=${2:?--days needs a value}; shift 2 ;;
    --force) FORCE=1; shift ;;
    --new-ca) NEW_CA=1 FORCE=1; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option '$1'" ;;
    *)
      [[ -z $OUT ]] || { usage >&2; die "one OUT_DIR only (got '$OUT' and '$1')"; }
      OUT=$1
      shift
      ;;
  esac
done
[[ -n $OUT ]] || { usage >&2; die "OUT_DIR is missing"; }
[[ $DAYS =~ ^[1-9][0-9]*$ ]] || die "--days takes a positive whole number, got '$DAYS'"
command -v openssl >/dev/null ||
  die "openssl not found: install Debian's openssl ('bash scripts/install_deps.sh' does)"

# The prefill certificate's SANs: every name asked for, then localhost and 127.0.0.1.
DNS_NAMES=() IP_NAMES=()
add_name() {
  local n=$1 x
  if [[ $n =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ || $n == *:* ]]; then
    [[ $n == *:* && ! $n =~ ^[0-9A-Fa-f:.]+$ ]] && die "'$n' is not an IPv6 address"
    for x in "${IP_NAMES[@]+"${IP_NAMES[@]}"}"; do [[ $x == "$n" ]] && return; done
    IP_NAMES+=("$n")
  elif [[ $n =~ ^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$ ]]; then
    for x in "${DNS_NAMES[@]+"${DNS_NAMES[@]}"}"; do [[ ${x,,} == "${n,,}" ]] && return; done
    DNS_NAMES+=("$n")
  else
    die "--prefill-names: '$n' is neither a DNS name nor an IP address"
  fi
}
if [[ -n $NAMES ]]; then
  IFS=, read -r -a requested <<<"$NAMES"
  for n in "${requested[@]}"; do
    [[ -n $n ]] || die "--prefill-names: an empty name in '$NAMES'"
    add_name "$n"
  done
fi
add_name localhost
add_name 127.0.0.1

# ---- helpers ------------------------------------------------------------------------------

mkdir -p "$OUT" 2>/dev/null || die "cannot create $OUT"
[[ -w $OUT ]] || die "$OUT is not writable"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvwire-certs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# One config for every step, so that nothing depends on the system's openssl.cnf.
write_config() {
  local i
  {
    cat <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = kvwire
[ca_ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[prefill_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = @prefill_names
[decode_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = DNS:kvwire-decode
[prefill_names]
EOF
    for i in "${!DNS_NAMES[@]}"; do echo "DNS.$((i + 1)) = ${DNS_NAMES[$i]}"; done
    for i in "${!IP_NAMES[@]}"; do echo "IP.$((i + 1)) = ${IP_NAMES[$i]}"; done
  } >"$WORK/openssl.cnf"
}
write_config

run_openssl() {  # openssl, its output shown only when it fails
  local out
  if ! out=$(openssl "$@" 2>&1); then
    echo "$out" >&2
    die "openssl $1 failed (above)"
  fi
}

new_key() {  # new_key PATH: an ECDSA P-256 key, mode 600 from the start
  (umask 077 && run_openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.new")
  mv -f "$1.new" "$1"
}

same_key() {  # same_key CERT KEY: the certificate is for this key
  [[ $(openssl x509 -in "$1" -noout -pubkey 2>/dev/null) == \
    "$(openssl pkey -in "$2" -pubout 2>/dev/null)" ]]
}

# Checks an existing identity; prints why it is not usable, if it is not.
unusable() {
  local id=$1 dir="$OUT/$1" n check
  [[ -r $dir/tls.crt && -r $dir/tls.key ]] || { echo "missing"; return; }
  openssl x509 -in "$dir/tls.crt" -noout 2>/dev/null || { echo "tls.crt is no certificate"; return; }
  same_key "$dir/tls.crt" "$dir/tls.key" || { echo "tls.key is not the key of tls.crt"; return; }
  openssl verify -CAfile "$OUT/ca.crt" "$dir/tls.crt" >/dev/null 2>&1 ||
    { echo "tls.crt is not signed by $OUT/ca.crt (or has expired)"; return; }
  openssl x509 -in "$dir/tls.crt" -noout -checkend 86400 >/dev/null ||
    { echo "tls.crt expires within a day"; return; }
  if [[ $id == prefill ]]; then
    for n in "${DNS_NAMES[@]}" "${IP_NAMES[@]}"; do
      [[ $n == *:* || $n =~ ^[0-9.]+$ ]] && check=-checkip || check=-checkhost
      [[ $(openssl x509 -in "$dir/tls.crt" -noout "$check" "$n") == *"does match"* ]] ||
        { echo "tls.crt does not name $n"; return; }
    done
  fi
}

issue() {  # issue ID SUBJECT: a new key and certificate for prefill or decode
  local id=$1 subject=$2 dir="$OUT/$1"
  mkdir -p "$dir"
  new_key "$dir/tls.key"
  run_openssl req -new -config "$WORK/openssl.cnf" -key "$dir/tls.key" -subj "$subject" \
    -out "$WORK/$id.csr"
  run_openssl x509 -req -in "$WORK/$id.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$DAYS" -sha256 \
    -extfile "$WORK/openssl.cnf" -extensions "${id}_ext" -out "$dir/tls.crt.new"
  mv -f "$dir/tls.crt.new" "$dir/tls.crt"
  chmod 644 "$dir/tls.crt"
}

# ---- the CA -------------------------------------------------------------------------------

if ((!NEW_CA)) && [[ -e $OUT/ca.crt || -e $OUT/ca.key ]]; then
  [[ -r $OUT/ca.crt && -r $OUT/ca.key ]] ||
    die "$OUT has one of ca.crt and ca.key but not both: restore the other, or make a new CA" \
      "with --new-ca (every node then needs the new files)"
  same_key "$OUT/ca.crt" "$OUT/ca.key" || die "$OUT/ca.key is not the key of $OUT/ca.crt"
  openssl x509 -in "$OUT/ca.crt" -noout -checkend 86400 >/dev/null ||
    die "the CA $OUT/ca.crt has expired or expires within a day: make a new one with --new-ca"
  say "kept the CA $OUT/ca.crt"
else
  ca_days=$((DAYS > 3650 ? DAYS : 3650))
  new_key "$OUT/ca.key"
  run_openssl req -x509 -new -config "$WORK/openssl.cnf" -key "$OUT/ca.key" \
    -subj "/CN=kvwire node CA" -set_serial "0x$(openssl rand -hex 16)" -days "$ca_days" \
    -sha256 -extensions ca_ext -out "$OUT/ca.crt.new"
  mv -f "$OUT/ca.crt.new" "$OUT/ca.crt"
  chmod 644 "$OUT/ca.crt"
  FORCE=1  # certificates of another CA are of no use
  say "made a new CA $OUT/ca.crt (valid $ca_days days)"
fi

# ---- the node certificates ----------------------------------------------------------------

for id in prefill decode; do
  subject="/CN=kvwire-$id"
  if ((FORCE)); then
    issue "$id" "$subject"
    say "issued $OUT/$id/tls.crt (valid $DAYS days)"
  else
    why=$(unusable "$id")
    if [[ $why == missing ]]; then
      [[ ! -e $OUT/$id/tls.crt && ! -e $OUT/$id/tls.key ]] ||
        die "$OUT/$id has one of tls.crt and tls.key but not both: reissue with" \
          "scripts/make_certs.sh $OUT --force"
      issue "$id" "$subject"
      say "issued $OUT/$id/tls.crt (valid $DAYS days)"
    elif [[ -n $why ]]; then
      die "$OUT/$id: $why; reissue with: scripts/make_certs.sh $OUT --force" \
        "${NAMES:+--prefill-names $NAMES}"
    else
      say "kept $OUT/$id/tls.crt"
    fi
  fi
  chmod 600 "$OUT/$id/tls.key"
  cp "$OUT/ca.crt" "$OUT/$id/ca.crt.new"
  mv -f "$OUT/$id/ca.crt.new" "$OUT/$id/ca.crt"
  chmod 644 "$OUT/$id/ca.crt"
done
chmod 600 "$OUT/ca.key"
