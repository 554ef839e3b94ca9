package sim

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
)

// Listen listens on addr: "unix:///abs/path" (a stale socket file there is
// replaced; any other file is refused) or "host:port".
func Listen(addr string) (net.Listener, error) {
	if path, ok := strings.CutPrefix(addr, "unix://"); ok {
		if !filepath.IsAbs(path) {
			return nil, fmt.Errorf("listen %q: a unix socket path must be absolute (unix:///abs/path)", addr)
		}
		if st, err := os.Lstat(path); err == nil {
			if st.Mode()&fs.ModeSocket == 0 {
				return nil, fmt.Errorf("listen %q: %s exists and is not a socket", addr, path)
			}
			if err := os.Remove(path); err != nil {
				return nil, fmt.Errorf("listen %q: remove stale socket: %w", addr, err)
			}
		}
		ln, err := net.Listen("unix", path)
		if err != nil {
			return nil, fmt.Errorf("listen %q: %w", addr, err)
		}
		if err := os.Chmod(path, 0o660); err != nil {
			ln.Close()
			return nil, fmt.Errorf("listen %q: %w", addr, err)
		}
		return ln, nil
	}
	if strings.Contains(addr, "://") {
		return nil, fmt.Errorf("listen %q: want unix:///abs/path or host:port", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %q: %w", addr, err)
	}
	return ln, nil
}
