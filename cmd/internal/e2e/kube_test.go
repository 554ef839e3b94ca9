package e2e_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"pilab.hu/pivirt-agent/cmd/internal/operator"
)

func init() {
	// controller-runtime's client logs through its global logger, which
	// otherwise complains that it was never set.
	ctrllog.SetLogger(logr.Discard())
}

// kubeClient is a controller-runtime client with the operator's scheme
// (core types and ManagedCertificate).
func kubeClient(t testing.TB, cfg *rest.Config) client.Client {
	t.Helper()
	s, err := operator.Scheme()
	if err != nil {
		t.Fatal(err)
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: s})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// applyManifests applies the YAML files as they are (server-side apply,
// every document of each), in order: a CRD is waited for until it is
// established before the next file.
func applyManifests(t testing.TB, cfg *rest.Config, files ...string) {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	kc := kubeClient(t, cfg)
	ctx := context.Background()
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
		for i := 0; ; i++ {
			var obj unstructured.Unstructured
			if err := dec.Decode(&obj.Object); err != nil {
				if errors.Is(err, io.EOF) {
					break
				}
				t.Fatalf("%s, document %d: %v", f, i, err)
			}
			if len(obj.Object) == 0 {
				continue
			}
			gvk := obj.GroupVersionKind()
			var mapping *meta.RESTMapping
			deadline := time.Now().Add(30 * time.Second)
			for {
				mapping, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: %s: %v", f, gvk, err)
				}
				mapper.Reset()
				time.Sleep(200 * time.Millisecond)
			}
			var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
			if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
				ri = dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace())
			}
			data, err := obj.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			force := true
			if _, err := ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: "e2e", Force: &force}); err != nil {
				t.Fatalf("apply %s %s/%s of %s: %v", gvk.Kind, obj.GetNamespace(), obj.GetName(), f, err)
			}
			if gvk.Kind == "CustomResourceDefinition" {
				waitFor(t, 30*time.Second, "CRD "+obj.GetName()+" established", func() error {
					var crd apiextensionsv1.CustomResourceDefinition
					if err := kc.Get(ctx, client.ObjectKey{Name: obj.GetName()}, &crd); err != nil {
						return err
					}
					for _, c := range crd.Status.Conditions {
						if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
							return nil
						}
					}
					return errors.New("not established yet")
				})
				mapper.Reset()
			}
		}
	}
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s: %v", what, timeout, err)
		}
		time.Sleep(pollInterval)
	}
}

// projectSecret writes a Secret's keys into dir as the kubelet does for a
// secret volume, and again at each change until ctx ends: the files are
// symbolic links into ..data, itself a link to a directory of the
// revision, swapped in one rename, so that a reader sees all the new files
// or all the old ones.
func projectSecret(ctx context.Context, t testing.TB, kc client.Client, key types.NamespacedName, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	write := func(s *corev1.Secret) error {
		rev, err := os.MkdirTemp(dir, "..rev-")
		if err != nil {
			return err
		}
		for k, v := range s.Data {
			if err := os.WriteFile(filepath.Join(rev, k), v, 0o600); err != nil {
				return err
			}
		}
		tmp := filepath.Join(dir, "..data_tmp")
		_ = os.Remove(tmp)
		if err := os.Symlink(filepath.Base(rev), tmp); err != nil {
			return err
		}
		if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
			return err
		}
		for k := range s.Data {
			link := filepath.Join(dir, k)
			if _, err := os.Lstat(link); err == nil {
				continue
			}
			if err := os.Symlink(filepath.Join("..data", k), link); err != nil {
				return err
			}
		}
		return nil
	}
	var last string
	sync := func() error {
		var s corev1.Secret
		if err := kc.Get(ctx, key, &s); err != nil {
			return err
		}
		if s.ResourceVersion == last {
			return nil
		}
		if err := write(&s); err != nil {
			return err
		}
		last = s.ResourceVersion
		return nil
	}
	waitFor(t, 60*time.Second, "Secret "+key.String()+" to project", sync)
	ctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	t.Cleanup(func() { stop(); <-done })
	go func() {
		defer close(done)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				if err := sync(); err != nil && !apierrors.IsNotFound(err) && ctx.Err() == nil && !strings.Contains(err.Error(), "context canceled") {
					t.Logf("project Secret %s: %v", key, err)
				}
			}
		}
	}()
}

// describe formats a value for a failure message.
func describe(v any) string { return fmt.Sprintf("%+v", v) }
