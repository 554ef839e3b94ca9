// Package servicedef reads service definition files: one service instance
// in YAML or JSON, as `pvcli service register --file` and the agent's
// services directory (service_discovery.services_dir) take them.
package servicedef

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"google.golang.org/protobuf/types/known/durationpb"
	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// Definition is a service definition file. JSON is read as YAML.
type Definition struct {
	Name    string            `yaml:"name"`
	ID      string            `yaml:"id"`
	Address string            `yaml:"address"`
	Port    int               `yaml:"port"`
	Tags    []string          `yaml:"tags"`
	Meta    map[string]string `yaml:"meta"`
	// TTL is the heartbeat interval the instance promises (not with Check).
	TTL   config.Duration `yaml:"ttl"`
	Check *Check          `yaml:"check"`
	// DeregisterCriticalAfter deregisters an instance critical for longer.
	DeregisterCriticalAfter config.Duration `yaml:"deregister_critical_after"`
}

// Check is a definition's check: one of http, tcp and grpc.
type Check struct {
	HTTP                   string          `yaml:"http"`
	TCP                    string          `yaml:"tcp"`
	GRPC                   string          `yaml:"grpc"`
	GRPCService            string          `yaml:"grpc_service"`
	GRPCUseTLS             bool            `yaml:"grpc_use_tls"`
	TLSSkipVerify          bool            `yaml:"tls_skip_verify"`
	Interval               config.Duration `yaml:"interval"`
	Timeout                config.Duration `yaml:"timeout"`
	SuccessBeforePassing   int             `yaml:"success_before_passing"`
	FailuresBeforeCritical int             `yaml:"failures_before_critical"`
}

// Parse reads a definition (YAML or JSON; unknown fields refused) and
// returns its instance. Errors name the field; the caller adds the file.
// The agent checks the rest when the instance is registered.
func Parse(data []byte) (*clusterv1.ServiceInstance, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var d Definition
	if err := dec.Decode(&d); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, errors.New("empty: a service definition needs at least name, address and port")
		}
		return nil, err
	}
	return d.Instance()
}

// Instance checks d's required fields and returns its instance.
func (d *Definition) Instance() (*clusterv1.ServiceInstance, error) {
	switch {
	case strings.TrimSpace(d.Name) == "":
		return nil, errors.New("name: required (the service's name)")
	case strings.TrimSpace(d.Address) == "":
		return nil, errors.New("address: required (the address the instance serves on)")
	case d.Port < 1 || d.Port > 65535:
		return nil, fmt.Errorf("port: %d, must be 1-65535", d.Port)
	case d.TTL < 0:
		return nil, fmt.Errorf("ttl: %s must not be negative", d.TTL)
	case d.DeregisterCriticalAfter < 0:
		return nil, fmt.Errorf("deregister_critical_after: %s must not be negative", d.DeregisterCriticalAfter)
	}
	inst := &clusterv1.ServiceInstance{
		Service: d.Name, InstanceId: d.ID, Address: d.Address, Port: uint32(d.Port),
		Tags: d.Tags, Meta: d.Meta,
	}
	if d.TTL > 0 {
		inst.Ttl = durationpb.New(d.TTL.Std())
	}
	if d.DeregisterCriticalAfter > 0 {
		inst.DeregisterCriticalAfter = durationpb.New(d.DeregisterCriticalAfter.Std())
	}
	if c := d.Check; c != nil {
		switch {
		case c.Interval < 0:
			return nil, fmt.Errorf("check.interval: %s must not be negative", c.Interval)
		case c.Timeout < 0:
			return nil, fmt.Errorf("check.timeout: %s must not be negative", c.Timeout)
		case c.SuccessBeforePassing < 0 || c.SuccessBeforePassing > 100:
			return nil, fmt.Errorf("check.success_before_passing: %d, must be 1-100 (0: 1)", c.SuccessBeforePassing)
		case c.FailuresBeforeCritical < 0 || c.FailuresBeforeCritical > 100:
			return nil, fmt.Errorf("check.failures_before_critical: %d, must be 1-100 (0: 1)", c.FailuresBeforeCritical)
		}
		inst.Check = &clusterv1.HealthCheck{
			Http: c.HTTP, Tcp: c.TCP, Grpc: c.GRPC, GrpcService: c.GRPCService, GrpcUseTls: c.GRPCUseTLS,
			TlsSkipVerify: c.TLSSkipVerify, SuccessBeforePassing: uint32(c.SuccessBeforePassing), FailuresBeforeCritical: uint32(c.FailuresBeforeCritical),
		}
		if c.Interval > 0 {
			inst.Check.Interval = durationpb.New(c.Interval.Std())
		}
		if c.Timeout > 0 {
			inst.Check.Timeout = durationpb.New(c.Timeout.Std())
		}
	}
	return inst, nil
}

// ReadFile reads and parses one definition file; errors name the file.
func ReadFile(path string) (*clusterv1.ServiceInstance, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	inst, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return inst, nil
}

// IsDefinition reports whether a directory entry's name is read as a
// definition: *.yaml, *.yml and *.json, not hidden.
func IsDefinition(name string) bool {
	ext := strings.ToLower(filepath.Ext(name))
	return !strings.HasPrefix(name, ".") && (ext == ".yaml" || ext == ".yml" || ext == ".json")
}

// File is one definition read from a directory.
type File struct {
	// Name is the file's name in the directory.
	Name     string
	Instance *clusterv1.ServiceInstance
}

// FileError is the error of one definition file of a directory.
type FileError struct {
	// Name is the file's name in the directory.
	Name string
	Err  error
}

func (e *FileError) Error() string { return e.Err.Error() }
func (e *FileError) Unwrap() error { return e.Err }

// ReadDir reads every definition file of dir, in name order. A file that
// does not parse is left out and its error (naming it) returned among
// errs; the others are read all the same.
func ReadDir(dir string) (files []File, errs []*FileError, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range entries {
		if e.IsDir() || !IsDefinition(e.Name()) {
			continue
		}
		inst, err := ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			errs = append(errs, &FileError{Name: e.Name(), Err: err})
			continue
		}
		files = append(files, File{Name: e.Name(), Instance: inst})
	}
	slices.SortFunc(files, func(a, b File) int { return strings.Compare(a.Name, b.Name) })
	return files, errs, nil
}
