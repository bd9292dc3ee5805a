//! `ai-lb-wasm-oci`: the filter as the OCI image Istio pulls, and istio/ rendered with its
//! digest. Run from the repository root after
//! `cargo build -p ai-lb-filter-wasm --target wasm32-wasip1 --release`
//! (istio/render.sh does both):
//!
//! ```text
//! ai-lb-wasm-oci layout   # writes target/wasm-oci/ai-lb-filter/, prints sha256:<manifest digest>
//! ai-lb-wasm-oci render   # the layout, then istio/ rendered into target/istio/
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use ai_lb_wasm_oci::{module, render, Image, Variant, DEFAULT_MODULE};
use anyhow::Context;
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ai-lb-wasm-oci",
    version,
    about = "Packs the ai-lb wasm filter as the OCI image Istio's WasmPlugin pulls (an OCI \
             image layout; the same .wasm always gives the same digest), and renders istio/ \
             with that digest."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write the OCI image layout (and optionally one tar of it); print the manifest digest.
    Layout(ImageArgs),
    /// Write the layout, then render the templates in --from into --out with its digest.
    Render {
        #[command(flatten)]
        image: ImageArgs,
        /// The template directory (its sha256 fields hold the template marker).
        #[arg(long, default_value = "istio")]
        from: PathBuf,
        /// Where the ready-to-apply manifests go (`kubectl apply -k <out>`).
        #[arg(long, default_value = "target/istio")]
        out: PathBuf,
        /// The module URL to write in place of the templates' (where you pushed the image,
        /// `oci://<registry>/<repo>:<tag>`, or where you serve the .wasm, `https://...`).
        #[arg(long)]
        url: Option<String>,
    },
}

#[derive(Args)]
struct ImageArgs {
    /// The filter module.
    #[arg(long, env = "AI_LB_WASM", default_value = DEFAULT_MODULE)]
    wasm: PathBuf,
    /// The OCI image layout directory to write (replaced if a layout is already there).
    #[arg(long, default_value = "target/wasm-oci/ai-lb-filter")]
    layout: PathBuf,
    /// Also write the layout as one tar file (for `skopeo copy oci-archive:<file>:<tag>`).
    #[arg(long)]
    archive: Option<PathBuf>,
    /// The tag recorded in the layout's index.json (`<layout>:<tag>` for oras, skopeo).
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    tag: String,
    /// "oci": custom wasm media types, the raw module as a layer; "compat": a standard
    /// tar+gzip layer holding plugin.wasm, for registries that refuse custom media types.
    #[arg(long, value_enum, default_value = "oci")]
    variant: Variant,
}

impl ImageArgs {
    fn build(&self) -> anyhow::Result<Image> {
        let (bytes, info) = module::read(&self.wasm)?;
        let image = Image::build(&bytes, &info, &self.tag, self.variant)?;
        image.write_layout(&self.layout)?;
        eprintln!(
            "module  {} ({} bytes, sha256 {}, {})",
            self.wasm.display(),
            bytes.len(),
            image.module_sha256,
            info.abi_versions.join(", ")
        );
        eprintln!(
            "layout  {} ({} variant, tag {}); push it with\n        \
             oras cp --from-oci-layout {}:{} <registry>/<repo>:{}   or   crane push {} <registry>/<repo>:{}",
            self.layout.display(),
            self.variant.name(),
            self.tag,
            self.layout.display(),
            self.tag,
            self.tag,
            self.layout.display(),
            self.tag
        );
        if let Some(a) = &self.archive {
            image.write_archive(a)?;
            eprintln!("archive {} (the layout as one tar)", a.display());
        }
        Ok(image)
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain on one line, without a backtrace: the message names the path
            // and what to do.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Layout(args) => {
            let image = args.build()?;
            eprintln!("manifest digest (the `sha256` of oci:// URLs, without `sha256:`):");
            println!("{}", image.manifest_digest);
        }
        Command::Render {
            image: args,
            from,
            out,
            url,
        } => {
            let image = args.build()?;
            let r = render::render(&from, &out, &image, url.as_deref())
                .with_context(|| format!("rendering {} into {}", from.display(), out.display()))?;
            println!("manifest digest {}", image.manifest_digest);
            println!("module sha256   {}", image.module_sha256);
            for m in &r.modules {
                println!("{}: {} sha256 {}", m.file, m.url, m.sha256);
            }
            println!(
                "rendered {} files into {}; apply with: kubectl apply -k {}",
                r.files.len(),
                out.display(),
                out.display()
            );
        }
    }
    Ok(())
}
