// Package release finds the releases CHANGELOG.md names and builds one
// from the commit it was cut from, for the tests that run a previous
// release beside this one (the upgrade test, the comparison of the state
// machines).
package release

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
)

// Release is one heading of CHANGELOG.md.
type Release struct {
	Version string
	// Commit is the commit it was cut from; "unreleased" for the release
	// being prepared.
	Commit string
}

// Unreleased is the commit of the release being prepared.
const Unreleased = "unreleased"

var heading = regexp.MustCompile(`^## (\S+) — commit (\S+)\s*$`)

// List reads the releases of the CHANGELOG.md at path, newest first.
func List(path string) ([]Release, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []Release
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if m := heading.FindStringSubmatch(sc.Text()); m != nil {
			out = append(out, Release{Version: m[1], Commit: m[2]})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no release heading (## VERSION — commit COMMIT)", path)
	}
	return out, sc.Err()
}

// Previous is the newest release of the CHANGELOG.md at path that was cut
// from a commit, other than version (the release the repository is).
func Previous(path, version string) (Release, error) {
	list, err := List(path)
	if err != nil {
		return Release{}, err
	}
	for _, r := range list {
		if r.Commit != Unreleased && r.Version != version {
			return r, nil
		}
	}
	return Release{}, fmt.Errorf("%s: no release before %s was cut from a commit", path, version)
}

// Root is the root of the repository the working directory is in (where
// go.mod is).
func Root() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("not inside the module")
	}
	return filepath.Dir(gomod), nil
}

// Source writes the tree of commit (from the repository at root, which
// must have its history) into dir.
func Source(ctx context.Context, root, commit, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	archive := exec.CommandContext(ctx, "git", "-C", root, "archive", "--format=tar", commit)
	extract := exec.CommandContext(ctx, "tar", "-x", "-C", dir)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return err
	}
	extract.Stdin = pipe
	// One buffer each: os/exec copies each process's stderr in a goroutine
	// of its own.
	var archiveErrs, extractErrs bytes.Buffer
	archive.Stderr, extract.Stderr = &archiveErrs, &extractErrs
	if err := extract.Start(); err != nil {
		return err
	}
	if err := archive.Run(); err != nil {
		_ = extract.Wait()
		return fmt.Errorf("git archive %s (the repository needs its history; a shallow clone lacks the commit): %w: %s%s", commit, err, archiveErrs.String(), extractErrs.String())
	}
	if err := extract.Wait(); err != nil {
		return fmt.Errorf("extract %s: %w: %s", commit, err, extractErrs.String())
	}
	return nil
}

// Build builds the packages (./cmd/pivirt-agent, ...) of commit into a
// directory of the user's cache kept per commit and Go release, and
// returns it: a second build of the same commit costs nothing. Extra is
// a map of file paths (relative to the source tree) to their content,
// written before the build (a program of the test's own).
func Build(ctx context.Context, root, commit string, pkgs []string, extra map[string]string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	key := fmt.Sprintf("%s-%s", commit, runtime.Version())
	if len(extra) > 0 {
		var names []string
		for p, c := range extra {
			names = append(names, p, fmt.Sprint(len(c)), fmt.Sprintf("%x", sum(c)))
		}
		key += fmt.Sprintf("-%x", sum(strings.Join(names, ",")))
	}
	bin := filepath.Join(cache, "pivirt-agent-releases", key, "bin")
	done := filepath.Join(bin, ".built-"+fmt.Sprintf("%x", sum(strings.Join(pkgs, ","))))
	if _, err := os.Stat(done); err == nil {
		return bin, nil
	}
	src := filepath.Join(cache, "pivirt-agent-releases", key, "src")
	if err := os.RemoveAll(src); err != nil {
		return "", err
	}
	if err := Source(ctx, root, commit, src); err != nil {
		return "", err
	}
	for p, c := range extra {
		path := filepath.Join(src, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(path, []byte(c), 0o644); err != nil {
			return "", err
		}
	}
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return "", err
	}
	args := append([]string{"build", "-o", bin + string(filepath.Separator)}, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod -buildvcs=false")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build release %s: go %s: %w\n%s", commit, strings.Join(args, " "), err, out)
	}
	if err := os.WriteFile(done, nil, 0o644); err != nil {
		return "", err
	}
	return bin, nil
}

// sum is a cache key of s (FNV-1a), not a checksum.
func sum(s string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(s))
	return h.Sum64()
}
