# shellcheck shell=bash
# The Debian mirror the chroots and images are made from: the one this
# machine's apt uses, so that a site's mirror or proxy is followed. Sourced.
#
#   debian_mirror
#     Prints $ACTSTASH_DEBIAN_MIRROR when set; else the first main-archive URI
#     of /etc/apt/sources.list.d/*.sources (deb822 'URIs:' of a 'Types: deb'
#     stanza), else of /etc/apt/sources.list ('deb' lines); security archives
#     (a different tree) are skipped. http://deb.debian.org/debian when apt
#     names none.

debian_mirror() {
  if [ -n "${ACTSTASH_DEBIAN_MIRROR:-}" ]; then
    echo "$ACTSTASH_DEBIAN_MIRROR"
    return 0
  fi
  local uri="" file
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -r "$file" ] || continue
    uri=$(awk '
      function flush() { if (deb && !off && uris != "" && !found) { print uris; found = 1 }; deb = off = 0; uris = "" }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]*#/ { next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      tolower($1) == "enabled:" && tolower($2) == "no" { off = 1 }
      tolower($1) == "uris:" { for (i = 2; i <= NF; i++) if ($i !~ /security/) { uris = $i; break } }
      END { flush() }' "$file" | head -n 1)
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                             if ($i !~ /security/) { print $i; exit } }' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
