#!/usr/bin/env bash
# Writes a test PKI into $1: ca.pem/ca.key, server.pem/server.key (localhost,
# 127.0.0.1), client.pem/client.key (signed by ca), and rogue-ca.pem with
# rogue.pem/rogue.key (a client certificate the daemon's CA did not sign).
set -euo pipefail
dir=$1
cd "$dir"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
ca() {  # name
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$1" 2>/dev/null
}
leaf() {  # name ca extensions
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -out "$1.pem" \
    -days 2 -extfile "$1.ext" 2>/dev/null
}
ca ca
ca rogue-ca
leaf server ca "subjectAltName=DNS:localhost,IP:127.0.0.1"
leaf client ca "extendedKeyUsage=clientAuth"
leaf rogue rogue-ca "extendedKeyUsage=clientAuth"
