# Sourced by the GPU scripts (run from the repository root): `erlang_here` unpacks the Debian
# Erlang/Elixir packages carried in .gpu/debs into /tmp/erlroot, points their start scripts
# there, and puts Erlang, Elixir and the carried apps (.gpu/erl_libs) on PATH / ERL_LIBS; mix
# runs in the test environment with the NIF the harness built (priv/native, not recompiled).
erlang_here() {
  local root=/tmp/erlroot
  rm -rf $root && mkdir -p $root
  for d in .gpu/debs/*.deb; do dpkg -x "$d" $root; done
  local er=$root/usr/lib/erlang
  for f in $er/bin/erl $er/erts-*/bin/erl $er/bin/start $er/erts-*/bin/start; do
    [ -f "$f" ] && sed -i "s|ROOTDIR=/usr/lib/erlang|ROOTDIR=$er|g" "$f"
  done
  export PATH=$er/bin:$root/usr/lib/elixir/bin:$PATH
  export ERL_LIBS=$PWD/.gpu/erl_libs
  export FUSED_KERNELS_SKIP_NIF=1 MIX_ENV=test
}
