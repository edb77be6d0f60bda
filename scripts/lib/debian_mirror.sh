# shellcheck shell=bash
# The Debian mirror the chroots and images are made from: the one this
# machine's apt uses, so that a site's mirror or proxy is followed. Sourced.
#
#   debian_mirror
#     Prints $ACTSTASH_DEBIAN_MIRROR when set; else the first main-archive URI
#     of /etc/apt/sources.list.d/*.sources (deb822 'URIs:' of a 'Types: deb'
#     stanza whose Suites name a Debian suite), else of /etc/apt/sources.list
#     ('deb' lines of a Debian suite); security archives (a different tree)
#     are skipped. http://deb.debian.org/debian when apt
#     names none.

# Suites of the Debian archive: a stanza or line for another (a vendor's
# repository, an Ubuntu host) is not the mirror.
DEBIAN_SUITES="bookworm bookworm-updates trixie trixie-updates forky forky-updates sid
  bullseye bullseye-updates stable stable-updates testing unstable oldstable"

debian_mirror() {
  if [ -n "${ACTSTASH_DEBIAN_MIRROR:-}" ]; then
    echo "$ACTSTASH_DEBIAN_MIRROR"
    return 0
  fi
  local uri="" file
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -r "$file" ] || continue
    uri=$(awk -v suites="$DEBIAN_SUITES" '
      BEGIN { n = split(suites, s, " "); for (i = 1; i <= n; i++) debian[s[i]] = 1 }
      function flush() {
        if (deb && !off && ours && uris != "" && !found) { print uris; found = 1 }
        deb = off = ours = 0; uris = "" }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]*#/ { next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      tolower($1) == "enabled:" && tolower($2) == "no" { off = 1 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i in debian) ours = 1 }
      tolower($1) == "uris:" { for (i = 2; i <= NF; i++) if ($i !~ /security/) { uris = $i; break } }
      END { flush() }' "$file" | head -n 1)
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri=$(awk -v suites="$DEBIAN_SUITES" '
      BEGIN { n = split(suites, s, " "); for (i = 1; i <= n; i++) debian[s[i]] = 1 }
      $1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                    if ($i !~ /security/ && ($(i + 1) in debian)) { print $i; exit } }' \
      /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
